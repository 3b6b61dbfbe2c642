"""NUMA balance of a container whose processes sit in cgroups of its own (cgroup v2, fake tree).

cgroup v2 lets no process stay in a cgroup whose controllers are handed down to children (the
"no internal process" rule): a container that makes cgroups below its own (Docker in Docker, a
systemd inside) moves every process of it into them, and its own ``cgroup.procs`` is empty while
its ``memory.numa_stat`` (hierarchical) still counts all their pages. Moving no process moves no
page; taking the hot node out of the container's ``cpuset.mems`` then migrates all of them at
once, in the writer, the unbounded step the balance exists to avoid.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.loops.numa_balance import NumaBalanceLoop
from tests.support.fakesys import GIB, MIB, FakeHost
from tests.support.numa_stat import read_stat, write_stat

UID = "11111111-0000-0000-0000-000000000001"
LOW = 1000  # pages: the 4 GiB floor is every node's watermark


class ProcessMover:
    """move_pages(2) as the kernel does it: only the pages of the processes it is given move."""

    def __init__(self, stat: Path, owners: set[int]) -> None:
        self.stat = stat
        self.owners = owners
        self.calls: list[list[int]] = []

    def __call__(self, pids: Sequence[int], hot: int, cool: int, budget: int,
                 timeout_s: float) -> tuple[Outcome, int, str]:
        self.calls.append(list(pids))
        on = read_stat(self.stat)
        moved = min(budget, on[hot]) if self.owners & set(pids) else 0
        on[hot] -= moved
        on[cool] += moved
        write_stat(self.stat, on)
        return Outcome.WRITTEN, moved, ""


def test_the_processes_of_the_containers_own_cgroups_are_moved_and_its_binding_kept(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2, driver="cgroupfs")
    pod = host.add_pod(UID, tier="besteffort",
                       annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
    container = host.cg("cpuset", pod.containers[0].rel)
    write_stat(container / "memory.numa_stat", {0: 200 * MIB, 1: 0})
    (container / "cpuset.mems").write_text("0\n")
    pid = pod.containers[0].pids[0]
    (container / "init").mkdir()
    (container / "init/cgroup.procs").write_text(f"{pid}\n")
    (container / "cgroup.procs").write_text("")
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    state = NodeState()
    state.replace_all(*host.nri())
    cfg = Config()
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    mover = ProcessMover(container / "memory.numa_stat", {pid})
    loop = NumaBalanceLoop(lambda: cfg, state, sysfs, layout_for(sysfs), AuditLog(sink),
                           mover=mover, clock=lambda: 10.0)
    loop.cycle(0.0)
    assert mover.calls == [[pid]]
    assert read_stat(container / "memory.numa_stat") == {0: 136 * MIB, 1: 64 * MIB}
    # 136 MiB still on node 0: it stays in the binding, no write migrates them in one go
    assert (container / "cpuset.mems").read_text().strip() == "0-1"
