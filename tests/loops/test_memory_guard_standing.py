"""Where the memory guard holds a standing cap (``memory_guard.standing_cap``), and what it
writes where it holds none: the ladder's squeeze alone, and what the tier had before once the
squeeze ends. On cgroup v2 by default the guard holds no standing cap; on v1 it does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from nri_plugin.report.features import FEATURES
from reconciler.host.cgroups import layout_for
from reconciler.host.probe import probe_host
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_guard import NOTES, MemoryGuardLoop
from reconciler.loops.memory_squeeze import GuardSqueeze, Squeeze
from reconciler.metrics import ReconcilerMetrics
from tests.support.counting import CountingSysFs
from tests.support.fakesys import GIB, MIB, UNLIMITED_V1, FakeHost

SQUEEZE = Squeeze(64 * MIB, 256 * MIB, "psi node 42 percent")


class Guard:
    """A guard on a fake node of ``version`` whose free memory would give the tier a cap of
    its 2 GiB plus 4 GiB of headroom, with its configuration switchable between cycles."""

    def __init__(self, tmp_path: Path, version: int, standing_cap: str) -> None:
        self.host = FakeHost(tmp_path, version=version,
                             driver="systemd" if version == 2 else "cgroupfs")
        self.host.set_numa([(8 * GIB, 32 * GIB, 0)])
        self.host.set_tier_usage("besteffort", 2 * GIB, per_node=[2 * GIB])
        self.set(standing_cap)
        self.sink = MemoryAuditSink()
        audit = AuditLog(self.sink)
        sysfs = SysFs(tmp_path, audit)
        self.squeeze = GuardSqueeze()
        self.metrics = ReconcilerMetrics()
        self.notes = StateFile(None)
        self.loop = MemoryGuardLoop(lambda: self.cfg, sysfs, layout_for(sysfs), audit,
                                    self.squeeze, self.metrics, notes=self.notes)

    def set(self, standing_cap: str) -> None:
        base = Config()
        self.cfg = dataclasses.replace(base, memory_guard=dataclasses.replace(
            base.memory_guard, standing_cap=standing_cap, watermark_floor_percent=100.0))

    def files(self) -> dict[str, str]:
        d = self.host.tier_dir("besteffort")
        names = ("memory.max", "memory.high") if self.host.version == 2 \
            else ("memory.limit_in_bytes",)
        return {name: (d / name).read_text().strip() for name in names}

    def cap_series(self) -> float | None:
        return self.metrics.registry.get_sample_value("nri_qos_memory_guard_cap_bytes")


ORIGINAL = {2: {"memory.max": "max", "memory.high": "max"},
            1: {"memory.limit_in_bytes": UNLIMITED_V1}}
CAP = 6 * GIB  # the tier's 2 GiB and the node's free 8 GiB above the 4 GiB floor


@pytest.mark.parametrize(("standing_cap", "version", "capped"), [
    ("cgroup-v1", 1, True), ("cgroup-v1", 2, False),
    ("always", 1, True), ("always", 2, True),
    ("never", 1, False), ("never", 2, False),
])
def test_the_standing_cap_is_held_where_the_setting_says(tmp_path: Path, standing_cap: str,
                                                         version: int, capped: bool) -> None:
    guard = Guard(tmp_path, version, standing_cap)
    guard.loop.cycle(0.0)
    limit = "memory.max" if version == 2 else "memory.limit_in_bytes"
    if capped:
        assert guard.files()[limit] == str(CAP)
        assert [r["cap_bytes"] for r in guard.sink.named("memory_guard_cap")] == [CAP]
        assert guard.cap_series() == CAP
    else:
        assert guard.files() == ORIGINAL[version]
        assert guard.sink.records == []
        assert guard.cap_series() is None  # no cap held: the series is absent
        assert guard.notes.entries(NOTES) == {}
    assert guard.metrics.registry.get_sample_value(
        "nri_qos_reclaimed_tier_usage_bytes") == 2 * GIB


def test_by_default_v2_holds_no_standing_cap_and_v1_does(tmp_path: Path) -> None:
    assert Config().memory_guard.standing_cap == "cgroup-v1"
    assert not Config().memory_guard.standing(v2=True)
    assert Config().memory_guard.standing(v2=False)


def test_v2_without_a_standing_cap_a_squeeze_is_memory_high_alone(tmp_path: Path) -> None:
    guard = Guard(tmp_path, 2, "cgroup-v1")
    guard.squeeze.set(SQUEEZE)
    guard.loop.cycle(0.0)
    tight = 2 * GIB - 64 * MIB  # a step below the usage
    assert guard.files() == {"memory.max": "max", "memory.high": str(tight)}
    [record] = guard.sink.named("memory_guard_cap")
    assert record["cap_bytes"] is None
    assert record["high_bytes"] == tight
    assert record["squeezed"] is True
    assert guard.cap_series() is None
    guard.loop.cycle(1.0)  # held: nothing new
    assert len(guard.sink.named("memory_guard_cap")) == 1
    guard.squeeze.set(None)
    guard.loop.cycle(2.0)
    assert guard.files() == ORIGINAL[2]
    assert guard.notes.entries(NOTES) == {}


def test_v1_without_a_standing_cap_a_squeeze_is_the_limit_and_its_end_gives_it_back(
        tmp_path: Path) -> None:
    guard = Guard(tmp_path, 1, "never")
    guard.squeeze.set(SQUEEZE)
    guard.loop.cycle(0.0)
    assert guard.files() == {"memory.limit_in_bytes": str(2 * GIB - 64 * MIB)}
    [record] = guard.sink.named("memory_guard_cap")
    assert record["cap_bytes"] == 2 * GIB - 64 * MIB
    guard.squeeze.set(None)
    guard.loop.cycle(1.0)
    assert guard.files() == ORIGINAL[1]


def test_a_reload_that_drops_the_standing_cap_gives_the_tier_back(tmp_path: Path) -> None:
    guard = Guard(tmp_path, 2, "always")
    guard.loop.cycle(0.0)
    assert guard.files()["memory.max"] == str(CAP)
    guard.set("cgroup-v1")
    guard.loop.cycle(1.0)
    assert guard.files() == ORIGINAL[2]
    assert guard.notes.entries(NOTES) == {}


def test_a_reload_that_drops_the_standing_cap_while_squeezed_keeps_the_squeeze_alone(
        tmp_path: Path) -> None:
    guard = Guard(tmp_path, 2, "always")
    guard.squeeze.set(SQUEEZE)
    guard.loop.cycle(0.0)
    assert guard.files()["memory.max"] == str(CAP)
    guard.set("never")
    guard.loop.cycle(1.0)
    # memory.max back to what it was before the guard; the squeeze held where it was
    assert guard.files() == {"memory.max": "max", "memory.high": str(2 * GIB - 64 * MIB)}
    guard.squeeze.set(None)
    guard.loop.cycle(2.0)
    assert guard.files() == ORIGINAL[2]


def test_a_squeeze_without_a_standing_cap_keeps_a_limit_the_tier_had(tmp_path: Path) -> None:
    """An operator's own memory.max on the tier stays; the squeeze throttles under it."""
    guard = Guard(tmp_path, 2, "cgroup-v1")
    (guard.host.tier_dir("besteffort") / "memory.max").write_text(f"{3 * GIB}\n")
    guard.squeeze.set(SQUEEZE)
    guard.loop.cycle(0.0)
    assert guard.files() == {"memory.max": str(3 * GIB), "memory.high": str(2 * GIB - 64 * MIB)}
    assert guard.sink.named("memory_guard_cap")[0]["cap_bytes"] == 3 * GIB
    guard.squeeze.set(None)
    guard.loop.cycle(1.0)
    assert guard.files() == {"memory.max": str(3 * GIB), "memory.high": "max"}


@pytest.mark.parametrize(("standing_cap", "version", "says"), [
    ("cgroup-v1", 2, "no standing cap on the BestEffort tier (memory_guard.standing_cap = "
                     "cgroup-v1); it is squeezed while the ladder's tune rung asks"),
    ("cgroup-v1", 1, "caps the BestEffort tier from the free memory of 1 NUMA node(s)"),
    ("always", 2, "caps the BestEffort tier from the free memory of 1 NUMA node(s)"),
])
def test_the_report_says_whether_the_guard_holds_a_standing_cap(
        tmp_path: Path, standing_cap: str, version: int, says: str) -> None:
    guard = Guard(tmp_path, version, standing_cap)
    host = probe_host(SysFs(tmp_path))
    feature = FEATURES["reconciler.memory_guard"](guard.cfg, host)
    assert feature.runs
    assert feature.detail == says


@pytest.mark.parametrize(("version", "reads"), [(1, True), (2, False)])
def test_the_report_says_whether_fulfillment_has_a_cap_to_read(
        tmp_path: Path, version: int, reads: bool) -> None:
    guard = Guard(tmp_path, version, "cgroup-v1")
    feature = FEATURES["detection.fulfillment"](guard.cfg, probe_host(SysFs(tmp_path)))
    assert feature.runs
    assert feature.detail.startswith("reads nothing here") is not reads


def test_without_a_standing_cap_or_a_squeeze_the_nodes_memory_is_not_read(
        tmp_path: Path) -> None:
    guard = Guard(tmp_path, 2, "cgroup-v1")
    sysfs = CountingSysFs(tmp_path, AuditLog(guard.sink))
    loop = MemoryGuardLoop(lambda: guard.cfg, sysfs, layout_for(sysfs), AuditLog(guard.sink),
                           guard.squeeze)
    loop.cycle(0.0)
    assert [p for p in sysfs.reads if "meminfo" in p or p == "/proc/zoneinfo"] == []
    guard.squeeze.set(SQUEEZE)  # a squeeze reads them
    loop.cycle(1.0)
    assert sysfs.reads["/proc/meminfo"] == 1
