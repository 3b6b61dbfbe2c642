"""One reclaimed container whose ``memory.numa_stat`` the kernel refuses to read (EISDIR here;
EACCES, EIO alike) is left out of NUMA balance, said once while it lasts; the other containers'
memory still moves off the hot node."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.loops.numa_balance import NumaBalanceLoop
from tests.support.fakesys import GIB, MIB, FakeHost, FakePod
from tests.support.numa_stat import write_stat

LOW = 1000  # pages


def reclaimed(host: FakeHost, n: int) -> FakePod:
    pod = host.add_pod(f"{n:08d}-0000-4000-8000-000000000000", tier="besteffort",
                       annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
    write_stat(host.cg("memory", pod.containers[0].rel) / "memory.numa_stat",
               {0: 200 * MIB, 1: 0})
    (host.cg("cpuset", pod.containers[0].rel) / "cpuset.mems").write_text("0-1\n")
    return pod


def test_one_containers_unreadable_numa_stat_leaves_the_others_balanced(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2, driver="cgroupfs")
    odd, batch = reclaimed(host, 1), reclaimed(host, 2)
    stat = host.cg("memory", odd.containers[0].rel) / "memory.numa_stat"
    stat.unlink()
    stat.mkdir()  # a read the kernel refuses
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    state = NodeState()
    state.replace_all(*host.nri())
    sysfs = SysFs(tmp_path, AuditLog(MemoryAuditSink()))
    moved: list[list[int]] = []

    def mover(pids: Sequence[int], hot: int, cool: int, budget: int,
              timeout_s: float) -> tuple[Outcome, int, str]:
        moved.append(list(pids))
        return Outcome.WRITTEN, budget, ""

    clock = [10.0]
    loop = NumaBalanceLoop(Config, state, sysfs, layout_for(sysfs), AuditLog(MemoryAuditSink()),
                           mover=mover, clock=lambda: clock[0])
    with capture_logs() as logs:
        for t in range(3):
            clock[0] += 10.0
            loop.cycle(float(t))
    assert moved
    assert all(pids == batch.containers[0].pids for pids in moved)
    said = [e for e in logs if e["event"] == "numa_balance_unreadable"]
    assert [e["error"].split(":")[0] for e in said] == ["EISDIR"]
