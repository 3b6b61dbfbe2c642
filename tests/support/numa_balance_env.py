"""The NUMA balance loop on a fake v2 tree: an offline and an online pod, two NUMA nodes, and a
mover standing in for move_pages(2)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.loops.numa_balance import NumaBalanceLoop
from reconciler.metrics import ReconcilerMetrics
from tests.support.counting import CountingSysFs
from tests.support.fakesys import GIB, MIB, FakeHost, FakePod
from tests.support.numa_stat import read_stat, write_stat

UID = "11111111-0000-0000-0000-000000000001"
WEB = "22222222-0000-0000-0000-000000000002"
LOW = 1000  # pages: the 4 GiB floor is every node's watermark


class FakeMover:
    """Stands in for move_pages(2): moves up to the budget between the container's
    ``memory.numa_stat`` figures and says how much it moved."""

    def __init__(self, stat: Path, result: Outcome = Outcome.WRITTEN) -> None:
        self.stat = stat
        self.result = result
        self.calls: list[tuple[list[int], int, int, int, float]] = []

    def __call__(self, pids: Sequence[int], hot: int, cool: int, budget: int,
                 timeout_s: float) -> tuple[Outcome, int, str]:
        self.calls.append((list(pids), hot, cool, budget, timeout_s))
        on = read_stat(self.stat)
        moved = min(budget, on[hot])
        on[hot] -= moved
        on[cool] += moved
        write_stat(self.stat, on)
        return self.result, moved, "" if self.result is Outcome.WRITTEN else "EACCES: refused"


def setup(tmp_path: Path, *, version: int = 2, dry_run: bool = False,
          observe: bool = False, step: int = 64 * MIB
          ) -> tuple[FakeHost, FakePod, FakePod, Config, CountingSysFs, MemoryAuditSink,
                     NodeState]:
    host = FakeHost(tmp_path, version=version, driver="cgroupfs")
    offline = host.add_pod(UID, tier="besteffort",
                           annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
    online = host.add_pod(WEB, tier="burstable")
    for pod, held in ((offline, 200 * MIB), (online, 3 * GIB)):
        write_stat(host.cg("memory", pod.containers[0].rel) / "memory.numa_stat",
                   {0: held, 1: 0})
        (host.cg("cpuset", pod.containers[0].rel) / "cpuset.mems").write_text("0\n")
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    state = NodeState()
    state.replace_all(*host.nri())
    base = Config()
    cfg = dataclasses.replace(base, numa_balance=dataclasses.replace(
        base.numa_balance, dry_run=dry_run, step_bytes=step))
    sink = MemoryAuditSink()
    sysfs = CountingSysFs(tmp_path, AuditLog(sink),
                          observe=(lambda: True) if observe else None)
    return host, offline, online, cfg, sysfs, sink, state


def loop_of(cfg: Config, state: NodeState, sysfs: SysFs, sink: MemoryAuditSink,
            mover: FakeMover | None, notes: StateFile | None = None,
            metrics: ReconcilerMetrics | None = None, clock: list[float] | None = None
            ) -> NumaBalanceLoop:
    times = clock if clock is not None else [0.0]
    return NumaBalanceLoop(lambda: cfg, state, sysfs, layout_for(sysfs), AuditLog(sink),
                           notes=notes, mover=mover, metrics=metrics, clock=lambda: times[0])


def mems(host: FakeHost, pod: FakePod) -> str:
    return (host.cg("cpuset", pod.containers[0].rel) / "cpuset.mems").read_text().strip()


def stat_of(host: FakeHost, pod: FakePod) -> Path:
    return host.cg("memory", pod.containers[0].rel) / "memory.numa_stat"
