"""NUMA balance of a container whose processes sit in a cgroup it made below its own, on a real
two-node cgroup v2 kernel (the fake-tree test: ``tests/loops/test_v2_numa_balance_nested.py``).

A cgroup that passes its controllers down holds no process (cgroup v2's "no internal process"
rule), so such a container (Docker in Docker, a systemd inside) lists none in its own
``cgroup.procs`` while its ``memory.numa_stat`` counts all their pages: the steps must move the
processes below it, and the pressed node must stay in its ``cpuset.mems`` while their pages are
on it (taking it out would migrate all of them in one write). Node 0 is made "pressed" as in
``test_numa_balance.py``: the memory guard's watermark floor above its free memory.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.sysfs import SysFs
from reconciler.loops.numa_balance import NumaBalanceLoop
from tests.support.guest_node import MIB, Node, free, numa_stat

pytestmark = pytest.mark.vm(numa=2, mem_mib=2048)

UID = "4e4e4e4e-0000-4000-8000-0000000000d1"
CID = "d" * 64
UNHURRIED_S = 120.0


def balance(floor: int, cgroups_path: str, cycles: int) -> MemoryAuditSink:
    base = Config()
    cfg = dataclasses.replace(
        base,
        memory_guard=dataclasses.replace(base.memory_guard, watermark_floor_bytes=floor,
                                         watermark_floor_percent=100.0),
        numa=dataclasses.replace(base.numa, enabled=False),
        numa_balance=dataclasses.replace(base.numa_balance, step_bytes=64 * MIB,
                                         rate_bytes_per_s=1 << 30,
                                         step_deadline_s=UNHURRIED_S))
    state = NodeState()
    state.replace_all(
        [PodInfo(id="sb", uid=UID, name="dind", namespace="test",
                 cgroup_parent=f"/kubepods/besteffort/pod{UID}",
                 annotations={"qos.nri-qos.io/level": "reclaimed_cores"})],
        [ContainerInfo(id=CID, pod_sandbox_id="sb", name="c", cgroups_path=cgroups_path)])
    sink = MemoryAuditSink()
    sysfs = SysFs("/", AuditLog(sink))
    loop = NumaBalanceLoop(lambda: cfg, state, sysfs, layout_for(sysfs), AuditLog(sink))
    for i in range(cycles):
        loop.cycle(float(i))
        time.sleep(0.2)  # past the rate limit's wait after a step
    return sink


def test_the_processes_below_the_container_move_in_steps_and_keep_their_node(
        node: Node) -> None:
    cgroup, path = node.container("besteffort", UID, CID)
    (cgroup / "cpuset.mems").write_text("0")
    (cgroup / "cgroup.subtree_control").write_text("+cpuset +memory")
    inner = node.mkdir(f"kubepods/besteffort/pod{UID}/{CID}/init")
    holder = node.holder(inner, 768)
    assert (cgroup / "cgroup.procs").read_text() == ""
    assert numa_stat(cgroup, "anon")[0] >= 760 * MIB
    floor = free(0) + 100 * MIB
    assert free(1) > floor + 300 * MIB
    steps = balance(floor, path, 12).named("numa_balance_step")
    seen = [(s["result"], int(str(s["moved_bytes"])) // MIB, s["reason"]) for s in steps]
    assert steps, "no step"
    assert all(s["result"] == "done" for s in steps), seen
    assert all(0 < int(str(s["moved_bytes"])) <= 67 * MIB for s in steps), seen
    moved = sum(int(str(s["moved_bytes"])) for s in steps)
    assert numa_stat(cgroup, "anon")[0] >= 760 * MIB - moved - 8 * MIB, seen
    assert (cgroup / "cpuset.mems").read_text().strip() == "0-1"
    holder.kill()
    holder.wait()
