"""NUMA binding and balance of a container whose parent's cpuset allows fewer nodes than the host
has (``AllowedMemoryNodes=`` on a slice, a v1 parent cpuset written by an operator): the nodes
the kernel lets it use are its parent's ``cpuset.mems.effective`` (v1:
``cpuset.effective_mems``), whatever its own ``cpuset.mems`` asks for."""

from __future__ import annotations

import dataclasses
import errno
from collections.abc import Sequence
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.host.values import parse_id_list
from reconciler.loops.numa_balance import NumaBalanceLoop
from reconciler.loops.numa_binding import NumaBindingLoop
from tests.support.fakesys import GIB, MIB, FakeHost
from tests.support.numa_stat import read_stat, write_stat
from tests.support.refusals import refuse_writes

UID = "11111111-0000-0000-0000-000000000001"
LOW = 1000  # pages: the 4 GiB floor is every node's watermark
RECLAIMED = {"qos.nri-qos.io/level": "reclaimed_cores"}


class CpusetMover:
    """move_pages(2) as the kernel does it: pages go only to a node in the container's
    ``cpuset.mems.effective`` (EACCES otherwise)."""

    def __init__(self, container: Path) -> None:
        self.container = container
        self.calls: list[tuple[int, int]] = []

    def __call__(self, pids: Sequence[int], hot: int, cool: int, budget: int,
                 timeout_s: float) -> tuple[Outcome, int, str]:
        self.calls.append((hot, cool))
        effective = (self.container / "cpuset.mems.effective").read_text()
        if cool not in parse_id_list(effective):
            return Outcome.FAILED, 0, "EACCES: Permission denied"
        stat = self.container / "memory.numa_stat"
        on = read_stat(stat)
        moved = min(budget, on[hot])
        on[hot] -= moved
        on[cool] += moved
        write_stat(stat, on)
        return Outcome.WRITTEN, moved, ""


def restricted_v2(tmp_path: Path, own_mems: str) -> tuple[FakeHost, Path]:
    """Two nodes, node 0 under its watermark and node 1 with room; the reclaimed pod's cgroup
    allows node 0 only, so its container has node 0 in effect whatever it asks for."""
    host = FakeHost(tmp_path, version=2, driver="cgroupfs")
    pod = host.add_pod(UID, tier="besteffort", annotations=RECLAIMED)
    container = pod.containers[0]
    cgroup = host.cg("cpuset", container.rel)
    (cgroup.parent / "cpuset.mems").write_text("0\n")
    (cgroup.parent / "cpuset.mems.effective").write_text("0\n")
    (cgroup / "cpuset.mems").write_text(own_mems + "\n")
    (cgroup / "cpuset.mems.effective").write_text("0\n")
    write_stat(cgroup / "memory.numa_stat", {0: 200 * MIB, 1: 0})
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    return host, cgroup


@pytest.mark.parametrize("own_mems", ["", "0-1"])
def test_a_node_the_parent_cpuset_does_not_allow_is_never_a_step_target(
        tmp_path: Path, own_mems: str) -> None:
    """Its own cpuset.mems empty (the parent's nodes) or naming node 1 (v2 accepts nodes the
    parent lacks, and keeps them out of effect): no page can go to node 1, so no step is
    taken and none is audited as failed, minute after minute."""
    host, cgroup = restricted_v2(tmp_path, own_mems)
    state = NodeState()
    state.replace_all(*host.nri())
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    mover = CpusetMover(cgroup)
    clock = [100.0]
    loop = NumaBalanceLoop(Config, state, sysfs, layout_for(sysfs), AuditLog(sink),
                           mover=mover, clock=lambda: clock[0])
    for minute in range(3):
        clock[0] = 100.0 + 61 * minute
        loop.cycle(clock[0])
    assert mover.calls == []
    assert sink.named("numa_balance_step") == []
    assert (cgroup / "cpuset.mems").read_text().strip() == own_mems


def test_v1_binding_stays_within_the_nodes_the_parent_cpuset_allows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """v1 refuses (EINVAL) a cpuset.mems naming a node its parent's does not: the binding
    binds to the nodes with headroom that the parent allows, and writes nothing refused."""
    host = FakeHost(tmp_path, version=1, driver="cgroupfs")
    pod = host.add_pod(UID, tier="besteffort", annotations=RECLAIMED)
    cgroup = host.cg("cpuset", pod.containers[0].rel)
    for d in (cgroup.parent, cgroup):
        (d / "cpuset.mems").write_text("1\n")
        (d / "cpuset.effective_mems").write_text("1\n")
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW),
                   (20 * GIB, 64 * GIB, LOW)])
    refused: list[str] = []

    def outside_parent(real: str, data: bytes) -> bool:
        if not real.endswith("/cpuset.mems"):
            return False
        parent = Path(real).parent.parent / "cpuset.mems"
        if parse_id_list(data.decode()) <= parse_id_list(parent.read_text()):
            return False
        refused.append(data.decode())
        return True

    refuse_writes(monkeypatch, errno.EINVAL, outside_parent)
    state = NodeState()
    state.replace_all(*host.nri())
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    cfg = Config()
    cfg = dataclasses.replace(cfg, numa=dataclasses.replace(cfg.numa, max_nodes=2))
    loop = NumaBindingLoop(lambda: cfg, state, sysfs, layout_for(sysfs), AuditLog(sink))
    for now in (0.0, 10.0, 20.0):
        loop.cycle(now)
    assert refused == []
    assert sink.named("cgroup_write_failed") == []
    assert (cgroup / "cpuset.mems").read_text().strip() == "1"
