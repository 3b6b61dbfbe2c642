"""Nodes of memory alone (in ``has_memory``, not ``has_cpu``: a CXL expander, HBM in flat mode, a
GPU's memory): the binding never adds one and keeps one a container has, the balance neither
empties nor fills one, the memory guard counts no room on one, ``numa_free`` does not judge one,
and the probe names them. Memoryless nodes (CPUs, no memory) count for nothing either."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.cli.probe import main_probe
from nri_plugin.config.schema import Config
from reconciler.detection.signals import Level, numa_scope
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import NumaNode, local_nodes, memory_only, read_nodes
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_guard import MemoryGuardLoop
from reconciler.loops.numa_binding import NumaBindingLoop
from tests.support.detection_env import Setup
from tests.support.fakesys import GIB, MIB, PAGE, FakeHost, write
from tests.support.guard_config import standing
from tests.support.numa_balance_env import FakeMover, loop_of, mems, setup, stat_of
from tests.support.numa_stat import read_stat, write_stat

LOW = 1000  # pages: the 4 GiB floor is every node's watermark
NODES = "sys/devices/system/node"


def sysfs_of(root: Path) -> SysFs:
    return SysFs(root, AuditLog(MemoryAuditSink()))


# -- the host layer --------------------------------------------------------------------------------

def test_memory_only_nodes_are_those_with_memory_and_no_cpu(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2)
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (0, 0, 0), (90 * GIB, 128 * GIB, LOW)],
                  memory_only=[2])
    sysfs = sysfs_of(tmp_path)
    assert memory_only(sysfs) == {2}  # node 1 has CPUs and no memory: not memory only
    assert [(n.id, n.memory_only) for n in read_nodes(sysfs, PAGE)] == [
        (0, False), (1, False), (2, True)]
    assert [n.id for n in local_nodes(read_nodes(sysfs, PAGE))] == [0]


def test_every_node_is_local_without_the_files_without_a_list_or_without_a_node_of_both(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2)
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)], memory_only=[1])
    sysfs = sysfs_of(tmp_path)
    assert memory_only(sysfs) == {1}
    for has_cpu, has_memory in (("x\n", "0-1\n"), ("0\n", "1-\n"), ("0\n", "1\n")):
        # not node lists; and memory on CPU-less nodes alone, as some virtual machines are made
        write(tmp_path / NODES / "has_cpu", has_cpu)
        write(tmp_path / NODES / "has_memory", has_memory)
        assert memory_only(sysfs) == frozenset(), (has_cpu, has_memory)
    (tmp_path / NODES / "has_cpu").unlink()
    write(tmp_path / NODES / "has_memory", "0-1\n")
    assert memory_only(sysfs) == frozenset()


def test_local_nodes_leave_out_memory_only_and_memoryless_nodes_unless_none_is_left() -> None:
    dram, memoryless = NumaNode(0, GIB, 64 * GIB, 0), NumaNode(1, 0, 0, 0)
    far = NumaNode(2, GIB, 64 * GIB, 0, memory_only=True)
    assert local_nodes([dram, memoryless, far]) == [dram]
    assert local_nodes([memoryless, far]) == [far]
    assert local_nodes([memoryless]) == [memoryless]


# -- NUMA binding ----------------------------------------------------------------------------------

def binding(tmp_path: Path, nodes: list[tuple[int, int, int]], far: list[int]
            ) -> tuple[FakeHost, NumaBindingLoop, MemoryAuditSink, list[Path]]:
    host = FakeHost(tmp_path, version=1, driver="cgroupfs")
    offline = host.add_pod("11111111-0000-0000-0000-000000000001", tier="besteffort",
                           containers=2)
    state = NodeState()
    state.replace_all(*host.nri())
    host.set_numa(nodes, memory_only=far)
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    loop = NumaBindingLoop(Config, state, sysfs, layout_for(sysfs), AuditLog(sink))
    files = [host.cg("cpuset", c.rel) / "cpuset.mems" for c in offline.containers]
    return host, loop, sink, files


def test_the_binding_never_adds_a_memory_only_node_and_keeps_one_a_container_has(
        tmp_path: Path) -> None:
    # Far memory has most headroom; node 1 is under its watermark.
    _, loop, sink, (first, second) = binding(
        tmp_path, [(20 * GIB, 64 * GIB, LOW), (2 * GIB, 64 * GIB, LOW),
                   (200 * GIB, 256 * GIB, LOW)], far=[2])
    second.write_text("0-2\n")
    write(second.parent / "cpuset.effective_mems", "0-2\n")
    loop.cycle(0.0)
    assert first.read_text() == "0"
    assert second.read_text() == "0,2"
    [record, _] = sink.named("numa_binding")
    assert record["reason"] == ("NUMA nodes with headroom: 0; nodes under watermark or not "
                                "chosen: 1; memory-only nodes kept as they are: 2")


def test_one_local_node_beside_far_memory_has_nothing_to_bind(tmp_path: Path) -> None:
    _, loop, sink, files = binding(tmp_path, [(2 * GIB, 64 * GIB, LOW),
                                              (200 * GIB, 256 * GIB, LOW)], far=[1])
    loop.cycle(0.0)
    assert [f.read_text() for f in files] == ["\n", "\n"]
    assert sink.named("numa_binding") == []


# -- NUMA balance ----------------------------------------------------------------------------------

def test_the_balance_moves_pages_to_a_local_node_not_to_far_memory(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    write_stat(stat_of(host, offline), {0: 200 * MIB, 1: 0, 2: 0})
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW),
                   (200 * GIB, 256 * GIB, LOW)], memory_only=[2])
    mover = FakeMover(stat_of(host, offline))
    loop_of(cfg, state, sysfs, sink, mover).cycle(0.0)
    assert [(c[1], c[2]) for c in mover.calls] == [(0, 1)]
    assert mems(host, offline) == "0-1"


def test_pages_on_far_memory_under_its_watermark_stay_there(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    write_stat(stat_of(host, offline), {0: 0, 1: 0, 2: 200 * MIB})
    (host.cg("cpuset", offline.containers[0].rel) / "cpuset.mems").write_text("0-2\n")
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW),
                   (1 * GIB, 256 * GIB, LOW)], memory_only=[2])
    mover = FakeMover(stat_of(host, offline))
    loop = loop_of(cfg, state, sysfs, sink, mover)
    loop.cycle(0.0)
    assert mover.calls == []
    assert read_stat(stat_of(host, offline)) == {0: 0, 1: 0, 2: 200 * MIB}
    assert mems(host, offline) == "0-2"


def test_one_local_node_beside_far_memory_has_nothing_to_balance(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (200 * GIB, 256 * GIB, LOW)], memory_only=[1])
    mover = FakeMover(stat_of(host, offline))
    loop = loop_of(cfg, state, sysfs, sink, mover)
    loop.cycle(0.0)
    assert mover.calls == []
    assert loop.interval() == 60.0  # looked at again as a host of one node is


# -- the memory guard ------------------------------------------------------------------------------

def guard(tmp_path: Path) -> tuple[FakeHost, MemoryGuardLoop]:
    host = FakeHost(tmp_path, version=1, driver="cgroupfs")
    cfg = standing()
    cfg = dataclasses.replace(cfg, memory_guard=dataclasses.replace(
        cfg.memory_guard, watermark_scale_factor=1.0, watermark_floor_percent=100.0))
    sysfs = sysfs_of(tmp_path)
    return host, MemoryGuardLoop(lambda: cfg, sysfs, layout_for(sysfs), AuditLog(
        MemoryAuditSink()))


def cap_of(host: FakeHost) -> int:
    return int((host.tier_dir("besteffort") / "memory.limit_in_bytes").read_text())


def test_far_memory_is_no_room_for_the_guard(tmp_path: Path) -> None:
    host, loop = guard(tmp_path)
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (10 * GIB, 64 * GIB, LOW),
                   (200 * GIB, 256 * GIB, LOW)], memory_only=[2])
    host.set_tier_usage("besteffort", 5 * GIB, per_node=[3 * GIB, 1 * GIB, 1 * GIB])
    loop.cycle(0.0)
    # what the tier holds, far memory's part too, and the local nodes' room above 4 GiB each
    assert cap_of(host) == 5 * GIB + (20 - 4) * GIB + (10 - 4) * GIB


def test_the_machine_view_leaves_out_far_memory_and_counts_the_floor_per_local_node(
        tmp_path: Path) -> None:
    host, loop = guard(tmp_path)
    host.set_numa([(1 * GIB, 2 * GIB, 0), (1 * GIB, 2 * GIB, 0), (0, 0, 0),
                   (100 * GIB, 100 * GIB, 0)], memory_only=[3])
    # hot-added memory the nodes do not show: the machine is taken as one node
    write(tmp_path / "proc/meminfo", f"MemTotal: {164 * GIB // 1024} kB\n"
                                     f"MemFree: {130 * GIB // 1024} kB\n")
    host.set_tier_usage("besteffort", 0, per_node=[0, 0, 0, 0])
    loop.cycle(0.0)
    assert cap_of(host) == (130 - 100) * GIB - 2 * 4 * GIB


# -- detection and the probe -----------------------------------------------------------------------

def test_numa_free_does_not_judge_a_node_of_memory_alone(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.host.set_numa([(40 * GIB, 64 * GIB, LOW), (GIB - MIB, 64 * GIB, LOW),
                     (GIB - MIB, 256 * GIB, LOW)], memory_only=[2])
    loop = s.loop()
    for at in (0.0, 1.0, 2.0):
        loop.cycle(at)
    assert s.level("numa_free", numa_scope(1)) is Level.MEDIUM
    assert s.level("numa_free", numa_scope(2)) is None


def test_the_probe_names_the_nodes_of_memory_alone(tmp_path: Path) -> None:
    root = tmp_path / "host"
    host = FakeHost(root, version=2)
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (90 * GIB, 128 * GIB, LOW)], memory_only=[1])
    config = tmp_path / "config.toml"
    config.write_text(f'[reconciler]\nroot = "{root}"\n[resctrl]\nenabled = false\n')
    out = io.StringIO()
    assert main_probe(str(config), as_json=True, out=out) == 0
    assert [n["memory_only"] for n in json.loads(out.getvalue())["numa_nodes"]] == [False, True]
    out = io.StringIO()
    assert main_probe(str(config), as_json=False, out=out) == 0
    [far] = [line for line in out.getvalue().splitlines() if "NUMA node 1" in line]
    assert far.endswith("memory only (no CPU): left to the kernel's tiering")
