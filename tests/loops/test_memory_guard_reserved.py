"""Memory guard: the cap never below kubelet's QOSReserved cap (allocatable minus the requests of
the pods outside the BestEffort tier) unless the ladder squeezes; v1 and v2."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from reconciler.host.cgroups import BESTEFFORT, layout_for
from reconciler.host.sysfs import SysFs
from reconciler.loops.common import ManagedCache, requested_outside
from reconciler.loops.memory_guard import MemoryGuardLoop, reserved_cap
from reconciler.loops.memory_squeeze import GuardSqueeze, Squeeze
from tests.support.fakesys import GIB, MIB, FakeHost
from tests.support.guard_config import standing

PAGE = 4096


class Requests:
    """What the runner passes: the memory the other pods requested, changeable by the test."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


def guard(tmp_path: Path, version: int, requests: Requests | None, *,
          squeeze: GuardSqueeze | None = None, **settings: Any
          ) -> tuple[FakeHost, MemoryGuardLoop, MemoryAuditSink]:
    host = FakeHost(tmp_path, version=version)
    cfg = standing(watermark_floor_percent=100.0, **settings)
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit)
    loop = MemoryGuardLoop(lambda: cfg, sysfs, layout_for(sysfs), audit, squeeze,
                           requests=requests)
    return host, loop, sink


def files(host: FakeHost) -> tuple[Path, Path]:
    """The tier's limit file and the kubepods cgroup's (what kubelet sets to allocatable)."""
    name = "memory.max" if host.version == 2 else "memory.limit_in_bytes"
    return host.tier_dir(BESTEFFORT) / name, host.tier_dir("guaranteed") / name


def full_node(host: FakeHost, allocatable: int | None) -> None:
    """A node whose free memory is under every watermark (page cache filled it): the free-based
    cap is the tier's usage, 1 GiB."""
    host.set_numa([(GIB, 8 * GIB, 0)])
    host.set_tier_usage(BESTEFFORT, GIB, per_node=[GIB])
    if allocatable is not None:
        files(host)[1].write_text(f"{allocatable}\n")


def test_reserved_cap_is_what_the_other_pods_did_not_request() -> None:
    assert reserved_cap(7 * GIB, 2 * GIB) == 5 * GIB
    assert reserved_cap(7 * GIB, 7 * GIB) == 0
    assert reserved_cap(7 * GIB, 8 * GIB) == 0


@pytest.mark.parametrize("version", [1, 2])
def test_a_full_node_caps_the_tier_at_allocatable_minus_requests(tmp_path: Path,
                                                                  version: int) -> None:
    host, loop, sink = guard(tmp_path, version, Requests(2 * GIB + 100))
    full_node(host, 7 * GIB)
    loop.cycle(0.0)
    reserved = (5 * GIB - 100) // PAGE * PAGE
    assert int(files(host)[0].read_text()) == reserved
    if version == 2:  # not throttled below kubelet's cap either
        assert int((host.tier_dir(BESTEFFORT) / "memory.high").read_text()) == reserved
    [record] = sink.named("memory_guard_cap")
    assert record["target_bytes"] == GIB
    assert record["reserved_bytes"] == reserved
    [write] = [w for w in sink.named("cgroup_write") if str(w["path"]).endswith(
        ("memory.max", "memory.limit_in_bytes"))]
    assert "allocatable - requests of the other pods" in str(write["reason"])


@pytest.mark.parametrize(("above", "winner"), [
    (-PAGE, "reserved"), (0, "reserved"), (PAGE, "target")])
def test_the_free_memory_cap_wins_from_a_page_above_the_reserved_one(
        tmp_path: Path, above: int, winner: str) -> None:
    host, loop, sink = guard(tmp_path, 1, Requests(2 * GIB))
    full_node(host, 7 * GIB)
    # usage 1 GiB + headroom: the free-based target lands `above` bytes from 5 GiB
    host.set_numa([(4 * GIB + 4 * GIB + above, 16 * GIB, 0)])
    loop.cycle(0.0)
    [record] = sink.named("memory_guard_cap")
    assert record["target_bytes"] == 5 * GIB + above
    assert record["cap_bytes"] == (5 * GIB if winner == "reserved" else 5 * GIB + above)


@pytest.mark.parametrize(("free", "requests", "cap", "high"), [
    # the free-memory cap (5 GiB) far above the reserved one (1 GiB): high_ratio of it
    (8 * GIB, 6 * GIB, 5 * GIB, int(5 * GIB * 0.95) // PAGE * PAGE),
    # a page above the reserved one (5 GiB): memory.high at the reserved cap, not 5 % under it
    (8 * GIB + PAGE, 2 * GIB, 5 * GIB + PAGE, 5 * GIB),
])
def test_v2_memory_high_is_high_ratio_of_the_cap_but_never_under_the_reserved_cap(
        tmp_path: Path, free: int, requests: int, cap: int, high: int) -> None:
    host, loop, _ = guard(tmp_path, 2, Requests(requests))
    full_node(host, 7 * GIB)
    host.set_numa([(free, 16 * GIB, 0)])
    loop.cycle(0.0)
    assert int(files(host)[0].read_text()) == cap
    assert int((host.tier_dir(BESTEFFORT) / "memory.high").read_text()) == high


@pytest.mark.parametrize("version", [1, 2])
def test_without_a_kubepods_limit_the_machine_is_allocatable(tmp_path: Path,
                                                             version: int) -> None:
    host, loop, _ = guard(tmp_path, version, Requests(3 * GIB))
    full_node(host, None)  # kubepods unlimited: MemTotal (8 GiB) stands for allocatable
    loop.cycle(0.0)
    assert int(files(host)[0].read_text()) == 5 * GIB


def test_an_unreadable_kubepods_limit_falls_back_to_the_machine(tmp_path: Path) -> None:
    host, loop, _ = guard(tmp_path, 2, Requests(3 * GIB))
    full_node(host, None)
    files(host)[1].write_text("garbage\n")
    loop.cycle(0.0)
    assert int(files(host)[0].read_text()) == 5 * GIB


@pytest.mark.parametrize("requests", [None, "off"])
def test_no_floor_without_requests_or_when_switched_off(tmp_path: Path,
                                                        requests: str | None) -> None:
    host, loop, sink = guard(tmp_path, 1, None if requests is None else Requests(0),
                             floor_from_requests=requests is None)
    full_node(host, 7 * GIB)
    loop.cycle(0.0)
    assert int(files(host)[0].read_text()) == GIB  # the free-based cap: the usage
    assert sink.named("memory_guard_cap")[0]["reserved_bytes"] is None


def test_requests_that_grow_lower_the_cap_one_step_at_a_time(tmp_path: Path) -> None:
    requests = Requests(GIB)
    host, loop, _ = guard(tmp_path, 1, requests, max_step_bytes=GIB)
    full_node(host, 7 * GIB)
    loop.cycle(0.0)
    assert int(files(host)[0].read_text()) == 6 * GIB
    requests.value = 5 * GIB  # an online pod of 4 GiB arrives
    caps = []
    for i in range(1, 6):
        loop.cycle(5.0 * i)
        caps.append(int(files(host)[0].read_text()) // GIB)
    assert caps == [5, 4, 3, 2, 2]  # a step a cycle, no OOM cliff, down to 7 - 5 GiB


@pytest.mark.parametrize("version", [1, 2])
def test_the_ladder_squeezes_below_the_reserved_cap(tmp_path: Path, version: int) -> None:
    squeeze = GuardSqueeze()
    host, loop, _ = guard(tmp_path, version, Requests(2 * GIB), squeeze=squeeze)
    full_node(host, 7 * GIB)
    loop.cycle(0.0)
    squeeze.set(Squeeze(step_bytes=256 * MIB, floor_bytes=256 * MIB, reason="psi"))
    loop.cycle(1.0)
    tight = GIB - 256 * MIB
    if version == 2:
        assert int((host.tier_dir(BESTEFFORT) / "memory.high").read_text()) == tight
        assert int(files(host)[0].read_text()) == 5 * GIB
    else:
        assert int(files(host)[0].read_text()) == tight


def test_the_requests_counted_are_those_outside_the_besteffort_tier(tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    online = host.add_pod("0nline-0000", tier="burstable", containers=2)
    whole = host.add_pod("guarant-000", tier="guaranteed")
    offline = host.add_pod("0ffline-000", tier="besteffort")
    pods, containers = host.nri()
    sized = {online.containers[0].info.id: 300 * MIB, online.containers[1].info.id: 200 * MIB,
             whole.containers[0].info.id: GIB, offline.containers[0].info.id: 64 * MIB}
    state = NodeState()
    state.replace_all(pods, [dataclasses.replace(c, memory_request=sized[c.id])
                             for c in containers])
    items = ManagedCache().get(state.snapshot())
    assert len(items) == 4
    assert requested_outside(items, BESTEFFORT) == 500 * MIB + GIB
