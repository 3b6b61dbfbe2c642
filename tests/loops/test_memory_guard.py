"""Memory guard: the Katalyst-style cap on the BestEffort tier, v1 and v2, step limits."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import NumaNode
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_guard import MemoryGuardLoop, bounded_cap, parse_numa_stat, target_cap
from reconciler.loops.memory_squeeze import GuardSqueeze, Squeeze
from reconciler.metrics import ReconcilerMetrics
from tests.support.counting import CountingSysFs
from tests.support.fakesys import (
    GIB,
    MIB,
    ONE_ZONE,
    READ_ONLY_NUMBER,
    FakeHost,
    refuse_writes,
    write,
)
from tests.support.guard_config import standing

STEP = 1 * GIB


def make(tmp_path: Path, version: int, driver: str, *, step: int = STEP,
         factor: float = 1.0) -> tuple[FakeHost, MemoryGuardLoop, MemoryAuditSink]:
    host = FakeHost(tmp_path, version=version, driver=driver)
    cfg = standing()
    # The floor unbounded by node size (tested on its own below): the whole 4 GiB applies.
    cfg = dataclasses.replace(cfg, memory_guard=dataclasses.replace(
        cfg.memory_guard, max_step_bytes=step, watermark_scale_factor=factor,
        watermark_floor_percent=100.0))
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit)
    loop = MemoryGuardLoop(lambda: cfg, sysfs, layout_for(sysfs), audit)
    return host, loop, sink


def limit_of(host: FakeHost) -> str:
    d = host.tier_dir("besteffort")
    return (d / ("memory.max" if host.version == 2 else "memory.limit_in_bytes")).read_text()


def test_formula_sums_usage_and_headroom_over_nodes() -> None:
    nodes = [NumaNode(0, 20 * GIB, 64 * GIB, 1 * GIB), NumaNode(1, 3 * GIB, 64 * GIB, 0),
             NumaNode(2, 9 * GIB, 64 * GIB, 2 * GIB)]
    # watermarks: max(4G, low x factor) -> 4G, 4G, 4G; node 1 is under it and adds nothing
    assert target_cap(nodes, 5 * GIB, 4 * GIB, 1.0) == 5 * GIB + 16 * GIB + 5 * GIB
    # a large scale factor lifts the watermark above the floor: 2G x 3 = 6G on node 2
    assert target_cap(nodes, 0, 4 * GIB, 3.0) == (20 - 4) * GIB + (9 - 6) * GIB


def test_bounded_cap() -> None:
    assert bounded_cap(10 * GIB, None, 2 * GIB, STEP) == 10 * GIB
    assert bounded_cap(10 * GIB, 30 * GIB, 2 * GIB, STEP) == 29 * GIB
    assert bounded_cap(40 * GIB, 30 * GIB, 2 * GIB, STEP) == 40 * GIB
    assert bounded_cap(1 * GIB, None, 10 * GIB, STEP) == 9 * GIB


def test_numa_stat_formats() -> None:
    v1 = "total=300 N0=100 N1=200\nfile=0 N0=0 N1=0\nhierarchical_total=3000 N0=1000 N1=2000\n"
    assert parse_numa_stat(v1, False, 4096) == {0: 1000 * 4096, 1: 2000 * 4096}
    assert parse_numa_stat("total=3 N0=1 N1=2\n", False, 4096) == {0: 4096, 1: 8192}
    v2 = "anon N0=10 N1=20\nfile N0=1 N1=2\nkernel_stack N0=5 N1=5\n"
    assert parse_numa_stat(v2, True, 4096) == {0: 11, 1: 22}


def test_v1_two_numa_nodes(tmp_path: Path) -> None:
    host, loop, sink = make(tmp_path, 1, "cgroupfs")
    host.set_numa([(20 * GIB, 64 * GIB, 1000), (10 * GIB, 64 * GIB, 1000)])
    host.set_tier_usage("besteffort", 5 * GIB, per_node=[3 * GIB, 1 * GIB])
    loop.cycle(0.0)
    cap = 4 * GIB + (20 - 4) * GIB + (10 - 4) * GIB
    assert int(limit_of(host)) == cap
    [record] = sink.named("memory_guard_cap")
    assert record["cap_bytes"] == cap
    assert record["previous_bytes"] is None
    assert record["path"] == "/sys/fs/cgroup/memory/kubepods/besteffort/memory.limit_in_bytes"
    # idle: nothing changed, nothing written
    loop.cycle(5.0)
    assert len(sink.named("cgroup_write")) == 1


def test_v2_four_numa_nodes_writes_max_and_high(tmp_path: Path) -> None:
    host, loop, sink = make(tmp_path, 2, "systemd")
    host.set_numa([(8 * GIB, 32 * GIB, 0)] * 4)
    host.set_tier_usage("besteffort", 2 * GIB, per_node=[GIB // 2] * 4)
    loop.cycle(0.0)
    cap = 2 * GIB + 4 * 4 * GIB
    d = host.tier_dir("besteffort")
    assert str(d).endswith("kubepods.slice/kubepods-besteffort.slice")
    assert int((d / "memory.max").read_text()) == cap
    assert int((d / "memory.high").read_text()) == int(cap * 0.95) // 4096 * 4096
    paths = [r["path"] for r in sink.named("cgroup_write")]
    # falling from "max": memory.high first
    assert paths[0].endswith("memory.high")
    assert paths[1].endswith("memory.max")


def test_cap_falls_by_at_most_one_step_per_cycle(tmp_path: Path) -> None:
    host, loop, sink = make(tmp_path, 2, "systemd")
    host.set_numa([(30 * GIB, 64 * GIB, 0), (30 * GIB, 64 * GIB, 0)])
    host.set_tier_usage("besteffort", 1 * GIB, per_node=[GIB // 2, GIB // 2])
    loop.cycle(0.0)
    assert int(limit_of(host)) == 1 * GIB + 52 * GIB
    # the nodes fill up: the target drops to the usage, the cap follows one step per cycle
    host.set_numa([(4 * GIB, 64 * GIB, 0), (4 * GIB, 64 * GIB, 0)])
    caps = []
    for i in range(3):
        loop.cycle(5.0 * (i + 1))
        caps.append(int(limit_of(host)))
    assert caps == [52 * GIB, 51 * GIB, 50 * GIB]
    # rising is not limited
    host.set_numa([(40 * GIB, 64 * GIB, 0), (40 * GIB, 64 * GIB, 0)])
    loop.cycle(20.0)
    assert int(limit_of(host)) == 1 * GIB + 72 * GIB
    high_first = [r["path"].rsplit("/", 1)[1] for r in sink.named("cgroup_write")[-2:]]
    assert high_first == ["memory.max", "memory.high"]


def test_cap_never_below_usage_minus_step(tmp_path: Path) -> None:
    host, loop, _ = make(tmp_path, 1, "cgroupfs")
    host.set_numa([(1 * GIB, 64 * GIB, 0), (1 * GIB, 64 * GIB, 0)])  # no headroom at all
    # page cache counted in numa_stat is small; the charged usage is 10 GiB
    host.set_tier_usage("besteffort", 10 * GIB, per_node=[GIB // 4, GIB // 4])
    loop.cycle(0.0)
    assert int(limit_of(host)) == 9 * GIB


def test_without_numa_stat_the_whole_usage_counts(tmp_path: Path) -> None:
    host, loop, _ = make(tmp_path, 1, "cgroupfs")
    host.set_numa([(6 * GIB, 64 * GIB, 0)])
    host.set_tier_usage("besteffort", 3 * GIB)
    loop.cycle(0.0)
    assert int(limit_of(host)) == 3 * GIB + 2 * GIB


@pytest.mark.parametrize(("version", "driver"), [(1, "cgroupfs"), (2, "systemd")])
def test_no_besteffort_cgroup_is_a_quiet_no_op(tmp_path: Path, version: int,
                                                driver: str) -> None:
    host, loop, sink = make(tmp_path, version, driver)
    host.set_numa([(6 * GIB, 64 * GIB, 0)])
    d = host.tier_dir("besteffort")
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    loop.cycle(0.0)
    assert sink.records == []


def test_disabled_guard_writes_nothing(tmp_path: Path) -> None:
    host, _loop, sink = make(tmp_path, 1, "cgroupfs")
    host.set_numa([(60 * GIB, 64 * GIB, 0)])
    host.set_tier_usage("besteffort", GIB)
    cfg = Config()
    off = dataclasses.replace(cfg, memory_guard=dataclasses.replace(cfg.memory_guard,
                                                                    enabled=False))
    sysfs = SysFs(tmp_path, AuditLog(sink))
    MemoryGuardLoop(lambda: off, sysfs, layout_for(sysfs), AuditLog(sink)).cycle(0.0)
    assert sink.records == []


def hot_added(host: FakeHost, nodes: list[tuple[int, int, int]], system_total: int,
              system_free: int) -> None:
    """Nodes' meminfo that does not add up to /proc/meminfo: memory hot-added to a VM is online
    but missing from the per-node totals (a real 24.7 GB VM shows 3.7 GB in node 0)."""
    host.set_numa(nodes)
    (host.root / "proc/meminfo").write_text(
        f"MemTotal:       {system_total // 1024} kB\nMemFree:        {system_free // 1024} kB\n")


def test_inconsistent_numa_view_caps_from_the_machine(tmp_path: Path) -> None:
    host, loop, sink = make(tmp_path, 1, "cgroupfs")
    hot_added(host, [(3 * GIB, 4 * GIB, 1000)], system_total=24 * GIB, system_free=20 * GIB)
    host.set_tier_usage("besteffort", 1 * GIB, per_node=[1 * GIB])
    loop.cycle(0.0)
    # The machine as one node: 1 G used + (20 G free - 4 G floor); not 1 G + (3 G - 4 G)+.
    assert int(limit_of(host)) == 1 * GIB + 16 * GIB
    [seen] = sink.named("numa_view_inconsistent")
    assert (seen["nodes_total_bytes"], seen["system_total_bytes"]) == (4 * GIB, 24 * GIB)
    assert "headroom over the machine" in sink.named("cgroup_write")[0]["reason"]
    loop.cycle(5.0)
    assert len(sink.named("numa_view_inconsistent")) == 1  # audited once, not every cycle


def test_inconsistent_view_floor_counts_once_per_numa_node(tmp_path: Path) -> None:
    host, loop, _ = make(tmp_path, 1, "cgroupfs")
    hot_added(host, [(1 * GIB, 2 * GIB, 0), (1 * GIB, 2 * GIB, 0)], system_total=64 * GIB,
              system_free=30 * GIB)
    host.set_tier_usage("besteffort", 0, per_node=[0, 0])
    loop.cycle(0.0)
    assert int(limit_of(host)) == 30 * GIB - 2 * 4 * GIB


@pytest.mark.parametrize(("nodes_total", "consistent"), [
    (9 * GIB, True),  # exactly 10 % apart: within the default tolerance
    (9 * GIB - 1024, False),  # one more kB apart (meminfo's unit): out of it
])
def test_tolerance_boundary(tmp_path: Path, nodes_total: int, consistent: bool) -> None:
    host, loop, sink = make(tmp_path, 1, "cgroupfs")
    hot_added(host, [(nodes_total // 2, nodes_total, 0)], system_total=10 * GIB,
              system_free=nodes_total // 2)
    host.set_tier_usage("besteffort", 0, per_node=[0])
    loop.cycle(0.0)
    assert bool(sink.named("numa_view_inconsistent")) is not consistent


def test_view_that_recovers_is_used_again(tmp_path: Path) -> None:
    host, loop, sink = make(tmp_path, 1, "cgroupfs")
    hot_added(host, [(3 * GIB, 4 * GIB, 0)], system_total=24 * GIB, system_free=20 * GIB)
    host.set_tier_usage("besteffort", 0, per_node=[0])
    loop.cycle(0.0)
    host.set_numa([(20 * GIB, 24 * GIB, 0)])  # consistent again (e.g. after a reboot of the VM)
    loop.cycle(5.0)
    assert int(limit_of(host)) == 20 * GIB - 4 * GIB
    assert len(sink.named("numa_view_inconsistent")) == 1


def test_kernel_without_numa_reads_meminfo_once_per_cycle(tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    write(tmp_path / "proc/meminfo", f"MemTotal: {16 * GIB // 1024} kB\n"
                                     f"MemFree: {10 * GIB // 1024} kB\n")
    write(tmp_path / "proc/zoneinfo", ONE_ZONE)
    host.set_tier_usage("besteffort", GIB)
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = CountingSysFs(tmp_path, audit)
    loop = MemoryGuardLoop(Config, sysfs, layout_for(sysfs), audit)
    loop.cycle(0.0)
    assert sysfs.reads["/proc/meminfo"] == 1
    # floor: 10 % of the machine's 16 GiB
    assert int(limit_of(host)) == (GIB + 10 * GIB - 16 * GIB // 10) // 4096 * 4096
    assert sink.named("numa_view_inconsistent") == []


@pytest.mark.skipif(not READ_ONLY_NUMBER.exists(), reason=f"no {READ_ONLY_NUMBER} here")
@pytest.mark.parametrize("squeezed", [False, True])
def test_a_refused_cap_is_not_recorded_and_the_guard_goes_on(tmp_path: Path,
                                                             squeezed: bool) -> None:
    host = FakeHost(tmp_path)
    host.set_numa([(20 * GIB, 64 * GIB, 0)])
    host.set_tier_usage("besteffort", GIB, per_node=[GIB])
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit)
    squeeze = GuardSqueeze()
    if squeezed:
        squeeze.set(Squeeze(64 * MIB, 256 * MIB, "test"))
    metrics = ReconcilerMetrics()
    loop = MemoryGuardLoop(Config, sysfs, layout_for(sysfs), audit, squeeze, metrics)
    limit = host.tier_dir("besteffort") / "memory.limit_in_bytes"
    refuse_writes(limit)
    loop.cycle(0.0)
    loop.cycle(5.0)
    assert sink.named("memory_guard_cap") == []
    # the same refusal at both cycles: said when it started
    assert [r["path"] for r in sink.named("cgroup_write_failed")] == [
        "/sys/fs/cgroup/memory/kubepods/besteffort/memory.limit_in_bytes"]
    # No cap held: the series is absent, not 0.
    assert metrics.registry.get_sample_value("nri_qos_memory_guard_cap_bytes") is None
    # the kernel takes the limit again: the next cycle writes and records it
    limit.unlink()
    limit.write_text("9223372036854771712\n")
    loop.cycle(10.0)
    [record] = sink.named("memory_guard_cap")
    assert record["squeezed"] is squeezed
    assert int(limit.read_text()) == record["cap_bytes"]


@pytest.mark.skipif(not READ_ONLY_NUMBER.exists(), reason=f"no {READ_ONLY_NUMBER} here")
def test_v2_a_refused_max_is_not_recorded_as_a_cap_even_when_high_was_written(
        tmp_path: Path) -> None:
    host, loop, sink = make(tmp_path, 2, "systemd")
    host.set_numa([(8 * GIB, 32 * GIB, 0)] * 4)
    host.set_tier_usage("besteffort", 2 * GIB, per_node=[GIB // 2] * 4)
    d = host.tier_dir("besteffort")
    refuse_writes(d / "memory.max")
    loop.cycle(0.0)
    [written] = sink.named("cgroup_write")
    assert written["path"].endswith("memory.high")
    assert [r["path"][-10:] for r in sink.named("cgroup_write_failed")] == ["memory.max"]
    assert sink.named("memory_guard_cap") == []
    # memory.max takes writes again: the cap is applied and recorded
    (d / "memory.max").unlink()
    (d / "memory.max").write_text("max\n")
    loop.cycle(5.0)
    [record] = sink.named("memory_guard_cap")
    assert int((d / "memory.max").read_text()) == record["cap_bytes"]


def test_a_missing_limit_file_writes_nothing_until_it_is_back(tmp_path: Path) -> None:
    host, loop, sink = make(tmp_path, 1, "cgroupfs")
    host.set_numa([(20 * GIB, 64 * GIB, 0)])
    host.set_tier_usage("besteffort", GIB, per_node=[GIB])
    limit = host.tier_dir("besteffort") / "memory.limit_in_bytes"
    limit.unlink()
    loop.cycle(0.0)
    assert sink.records == []
    assert not limit.exists()  # never created by the guard
    limit.write_text("9223372036854771712\n")
    loop.cycle(5.0)
    assert int(limit.read_text()) == GIB + (20 - 4) * GIB
    assert len(sink.named("memory_guard_cap")) == 1


# -- small nodes: the floor bounded by node size, and a cap never below the minimum -----------

def guard_on(tmp_path: Path, version: int, **guard: Any
             ) -> tuple[FakeHost, MemoryGuardLoop, MemoryAuditSink]:
    host = FakeHost(tmp_path, version=version, driver="cgroupfs")
    cfg = standing(**guard)
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit)
    return host, MemoryGuardLoop(lambda: cfg, sysfs, layout_for(sysfs), audit), sink


@pytest.mark.parametrize(("total", "floor"), [
    (40 * GIB, 4 * GIB),  # 10 % of 40 GiB is the 4 GiB floor itself
    (40 * GIB + 10 * 4096, 4 * GIB),  # above it the fixed floor holds
    (40 * GIB - 10 * 4096, 4 * GIB - 4096),  # below it the share does
    (3 * GIB, 3 * GIB // 10),
])
def test_the_floor_is_at_most_a_share_of_the_node(total: int, floor: int) -> None:
    node = NumaNode(0, total, total, 0)
    assert node.watermark(4 * GIB, 1.0, 10.0) == floor
    assert target_cap([node], 0, 4 * GIB, 1.0, 10.0) == total - floor


def test_two_small_numa_nodes_leave_the_tier_room(tmp_path: Path) -> None:
    """Two NUMA nodes of 3 GiB with 2.5 GiB free each: with the fixed 4 GiB floor the tier was
    capped at 0 (every offline pod OOM-killed); each node now keeps 10 % of its memory."""
    host, loop, _ = guard_on(tmp_path, 2)
    host.set_numa([(5 * GIB // 2, 3 * GIB, 1000)] * 2)
    host.set_tier_usage("besteffort", 0, per_node=[0, 0])
    loop.cycle(0.0)
    floor = 3 * GIB // 10
    assert int(limit_of(host)) == 2 * (5 * GIB // 2 - floor) // 4096 * 4096


@pytest.mark.parametrize("version", [1, 2])
def test_no_headroom_caps_at_the_minimum_not_at_zero(tmp_path: Path, version: int) -> None:
    host, loop, sink = guard_on(tmp_path, version, watermark_floor_percent=100.0)
    host.set_numa([(GIB, 4 * GIB, 0), (GIB, 4 * GIB, 0)])  # both under the 4 GiB floor
    host.set_tier_usage("besteffort", 0, per_node=[0, 0])
    loop.cycle(0.0)
    assert int(limit_of(host)) == 512 * MIB
    [record] = sink.named("memory_guard_cap")
    assert record["target_bytes"] == 0
    if version == 2:
        high = int((host.tier_dir("besteffort") / "memory.high").read_text())
        assert high == int(512 * MIB * 0.95) // 4096 * 4096


@pytest.mark.parametrize(("free_above_floor", "cap"), [
    (512 * MIB - 4096, 512 * MIB),  # a page short of the minimum: the minimum
    (512 * MIB, 512 * MIB),
    (512 * MIB + 4096, 512 * MIB + 4096),  # a page above it: the formula
])
def test_the_minimum_cap_boundary(tmp_path: Path, free_above_floor: int, cap: int) -> None:
    host, loop, _ = guard_on(tmp_path, 1, watermark_floor_percent=100.0)
    host.set_numa([(4 * GIB + free_above_floor, 64 * GIB, 0)])
    host.set_tier_usage("besteffort", 0, per_node=[0])
    loop.cycle(0.0)
    assert int(limit_of(host)) == cap
