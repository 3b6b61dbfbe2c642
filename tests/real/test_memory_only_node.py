"""A node of memory alone on a real v2 kernel: the guest's third NUMA node has memory and no CPU
(two CPUs over three nodes), as a CXL expander, HBM in flat mode or a GPU's memory appears. The
kernel names it in ``has_memory`` and not ``has_cpu``; the NUMA balance neither moves offline
pages onto it nor off it, and the binding never adds it and keeps it where a container has it.

A local node is made "pressed" by putting the memory guard's watermark floor above its free
memory and below the other nodes', as the other NUMA tests do.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import local_nodes, memory_only, read_nodes
from reconciler.host.sysfs import SysFs
from reconciler.host.values import PAGE_SIZE
from reconciler.loops.numa_balance import NumaBalanceLoop
from reconciler.loops.numa_binding import NumaBindingLoop
from tests.support.guest_node import MIB, Node, free, numa_stat, one_pod

pytestmark = pytest.mark.vm(numa=3, mem_mib=2048)

UID = "4e4e4e4e-0000-4000-8000-0000000000d1"
CID = "d" * 64
OTHER = "4e4e4e4e-0000-4000-8000-0000000000d2"
FAR = 2
# A step's deadline where the test is not about deadlines (a busy host stalls a guest).
UNHURRIED_S = 120.0


def config(floor: int, *, balance: bool = True) -> Config:
    base = Config()
    return dataclasses.replace(
        base,
        memory_guard=dataclasses.replace(base.memory_guard, watermark_floor_bytes=floor,
                                         watermark_floor_percent=100.0),
        numa=dataclasses.replace(base.numa, enabled=not balance),
        numa_balance=dataclasses.replace(base.numa_balance, enabled=balance,
                                         rate_bytes_per_s=1 << 30,
                                         step_deadline_s=UNHURRIED_S))


def balance(cfg: Config, cgroups_path: str, cycles: int) -> MemoryAuditSink:
    sink = MemoryAuditSink()
    sysfs = SysFs("/", AuditLog(sink))
    loop = NumaBalanceLoop(lambda: cfg, one_pod(UID, "reclaimed_cores", CID, cgroups_path),
                           sysfs, layout_for(sysfs), AuditLog(sink))
    for i in range(cycles):
        loop.cycle(float(i))
        time.sleep(0.2)  # past the rate limit's wait after a step
    return sink


def press(node: Node, on: int, other: int, gap: int) -> None:
    """An online pod's container holding memory on node ``on`` until it has ``gap`` bytes less
    free than node ``other`` (which nodes the guest's own processes use varies)."""
    extra = free(on) - free(other) + gap
    if extra > 0:
        cgroup, _ = node.container("burstable", OTHER, f"{on:x}" * 64)
        (cgroup / "cpuset.mems").write_text(str(on))
        node.holder(cgroup, extra // MIB)


def test_the_kernel_names_the_node_without_cpus() -> None:
    sysfs = SysFs("/")
    assert Path("/sys/devices/system/node/has_cpu").read_text().strip() == "0-1"
    assert memory_only(sysfs) == {FAR}
    nodes = read_nodes(sysfs, PAGE_SIZE)
    assert [(n.id, n.memory_only) for n in nodes] == [(0, False), (1, False), (FAR, True)]
    assert nodes[FAR].total_bytes > 1900 * MIB
    assert [n.id for n in local_nodes(nodes)] == [0, 1]


def test_offline_pages_move_to_the_local_node_with_room_not_to_far_memory(node: Node) -> None:
    cgroup, path = node.container("besteffort", UID, CID)
    (cgroup / "cpuset.mems").write_text("0")
    holder = node.holder(cgroup, 256)
    # far memory with most room, node 1 with room for steps, node 0 pressed
    press(node, 1, FAR, 200 * MIB)
    press(node, 0, 1, 600 * MIB)
    floor = free(0) + 100 * MIB
    assert free(1) > floor + 300 * MIB, "node 1 must have room for a step"
    assert free(FAR) > free(1), "far memory must have the most room"
    steps = balance(config(floor), path, 6).named("numa_balance_step")
    seen = [(s["from_node"], s["to_node"], s["result"], s["reason"]) for s in steps]
    assert steps, "no step"
    assert {(s["from_node"], s["to_node"]) for s in steps} == {(0, 1)}, seen
    after = numa_stat(cgroup, "anon")
    assert after.get(FAR, 0) < 2 * MIB, after
    assert after[1] >= 60 * MIB, after
    assert (cgroup / "cpuset.mems").read_text().strip() in ("0-1", "1"), seen
    holder.kill()
    holder.wait()


def test_offline_pages_on_far_memory_under_its_watermark_stay_there(node: Node) -> None:
    cgroup, path = node.container("besteffort", UID, CID)
    (cgroup / "cpuset.mems").write_text(str(FAR))
    holder = node.holder(cgroup, 1536)
    held = numa_stat(cgroup, "anon")[FAR]
    assert held >= 1528 * MIB
    # Widening moves nothing: the container may now use every node, its pages stay on far memory.
    (cgroup / "cpuset.mems").write_text("0-2")
    floor = free(FAR) + 100 * MIB
    assert min(free(0), free(1)) > floor + 300 * MIB, "the local nodes must have room"
    sink = balance(config(floor), path, 4)
    assert sink.named("numa_balance_step") == []
    assert numa_stat(cgroup, "anon")[FAR] >= held - 2 * MIB
    assert (cgroup / "cpuset.mems").read_text().strip() == "0-2"
    holder.kill()
    holder.wait()


@pytest.mark.parametrize(("before", "bound"), [("0-1", "0"), ("1-2", "0,2")])
def test_the_binding_never_adds_far_memory_and_keeps_it_where_a_container_has_it(
        node: Node, before: str, bound: str) -> None:
    cgroup, path = node.container("besteffort", UID, CID)
    (cgroup / "cpuset.mems").write_text(before)
    press(node, 1, 0, 400 * MIB)
    # Node 1 pressed; node 0 and far memory have room.
    floor = free(1) + 100 * MIB
    assert free(0) > floor + 100 * MIB, "node 0 must have room"
    assert free(FAR) > floor + 100 * MIB
    sink = MemoryAuditSink()
    sysfs = SysFs("/", AuditLog(sink))
    cfg = config(floor, balance=False)
    NumaBindingLoop(lambda: cfg, one_pod(UID, "reclaimed_cores", CID, path), sysfs,
                    layout_for(sysfs), AuditLog(sink)).cycle(0.0)
    assert (cgroup / "cpuset.mems").read_text().strip() == bound
    assert (cgroup / "cpuset.mems.effective").read_text().strip() == bound
    [record] = sink.named("numa_binding")
    assert record["mems"] == bound
