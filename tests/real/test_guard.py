"""The memory guard on a real cgroup v2 kernel, the guest being the whole node: by default it
holds no standing cap there (an offline pod takes more than the cap would have left it, and a
squeeze is ``memory.high`` alone); where it holds one (``standing_cap = "always"``) its cap on
the BestEffort tier (``memory.max`` and ``memory.high``) holds against a real writing process, a
squeeze lowers ``memory.high`` and its end lifts it back, a squeeze that throttles anonymous
memory holds a growing job where it is without killing it, the fulfillment detector reads the
cap, no node size gives a cap under the minimum, and a node full of page cache still leaves the
tier what the other pods did not request.
"""

from __future__ import annotations

import dataclasses
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.detection.publisher import Publisher
from reconciler.detection.service import DetectorsLoop
from reconciler.detection.signals import Board, Level
from reconciler.host.cgroups import layout_for
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_guard import MemoryGuardLoop
from reconciler.loops.memory_squeeze import GuardSqueeze, Squeeze
from tests.support.guest_node import CGROUP, MIB, Node, memory_stat, one_pod, read_int

pytestmark = pytest.mark.vm(numa=2, mem_mib=1024)

UID = "9a9a9a9a-0000-4000-8000-000000000001"
CID = "b" * 64
ONLINE_UID = "9a9a9a9a-0000-4000-8000-000000000002"
ONLINE_CID = "c" * 64
TIER = CGROUP / "kubepods/besteffort"


def guard(cfg: Config, squeeze: GuardSqueeze | None = None, requests: int | None = None
          ) -> tuple[MemoryGuardLoop, MemoryAuditSink]:
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs("/", audit)
    asked = None if requests is None else (lambda: requests)
    return MemoryGuardLoop(lambda: cfg, sysfs, layout_for(sysfs), audit, squeeze=squeeze,
                           requests=asked), sink


def standing(**guard: Any) -> Config:
    """The defaults, the guard holding a standing cap on this v2 node."""
    base = Config()
    return dataclasses.replace(base, memory_guard=dataclasses.replace(
        base.memory_guard, standing_cap="always", **guard))


def test_by_default_the_tier_has_no_standing_cap_and_a_squeeze_is_memory_high_alone(
        node: Node) -> None:
    """Settings under which the standing cap would be the 512 MiB minimum: by default nothing
    is written, an offline pod of 700 MiB of anonymous memory runs, and a squeeze throttles
    the tier at memory.high with memory.max left as it was."""
    cfg = Config()
    cfg = dataclasses.replace(cfg, memory_guard=dataclasses.replace(
        cfg.memory_guard, watermark_floor_bytes=1 << 40, watermark_floor_percent=100.0))
    squeeze = GuardSqueeze()
    loop, sink = guard(cfg, squeeze)
    loop.cycle(0.0)
    assert (TIER / "memory.max").read_text().strip() == "max"
    assert (TIER / "memory.high").read_text().strip() == "max"
    cgroup, _ = node.container("besteffort", UID, CID)
    holder = node.holder(cgroup, 700)
    loop.cycle(1.0)
    assert holder.poll() is None
    assert sink.records == []
    usage = read_int(TIER / "memory.current")
    # a step below the usage, the holder's anonymous memory not spared (at memory.high the
    # kernel throttles, never kills)
    squeeze.set(Squeeze(64 * MIB, 64 * MIB, "test", 1, spare_anonymous=False))
    loop.cycle(2.0)
    high = read_int(TIER / "memory.high")
    assert high < usage
    assert (TIER / "memory.max").read_text().strip() == "max"
    [record] = sink.named("memory_guard_cap")
    assert record["cap_bytes"] is None
    assert record["high_bytes"] == high
    squeeze.set(None)
    loop.cycle(3.0)
    assert (TIER / "memory.high").read_text().strip() == "max"
    assert holder.poll() is None
    events = dict(line.split() for line in (cgroup / "memory.events").read_text().splitlines())
    assert events["oom_kill"] == "0", events


def test_a_standing_cap_on_a_small_node_leaves_the_tier_room(node: Node) -> None:
    """Two NUMA nodes of 1 GiB: the fixed 4 GiB floor alone would cap the tier at 0."""
    loop, sink = guard(standing())
    loop.cycle(0.0)
    cap = read_int(TIER / "memory.max")
    high = read_int(TIER / "memory.high")
    minimum = Config().memory_guard.minimum_cap_bytes
    assert cap >= minimum
    assert high == int(cap * 0.95) // 4096 * 4096
    [record] = sink.named("memory_guard_cap")
    assert record["cap_bytes"] == cap
    # a pod of the tier starts and allocates under that cap
    cgroup, _ = node.container("besteffort", UID, CID)
    holder = node.holder(cgroup, 64)
    assert holder.poll() is None


def test_the_cap_holds_against_a_writing_process_and_a_squeeze_ends(node: Node) -> None:
    # the whole node but 256 MiB is kept from the tier: a cap well under the node's memory
    cfg = standing(minimum_cap_bytes=256 * MIB, watermark_floor_bytes=1 << 40,
                   watermark_floor_percent=100.0)
    squeeze = GuardSqueeze()
    loop, sink = guard(cfg, squeeze)
    loop.cycle(0.0)
    assert read_int(TIER / "memory.max") == 256 * MIB
    cgroup, _ = node.container("besteffort", UID, CID)
    worker = node.worker(cgroup, TIER)
    answer = worker.ask(f"dirty /var/tmp/guard.bin 1.0 {512}")
    assert answer["onset"] is not None, "the tier's cap was never reached"
    assert read_int(TIER / "memory.current") <= 256 * MIB
    assert read_int(TIER / "memory.peak") <= 256 * MIB if (TIER / "memory.peak").exists() \
        else True
    high = read_int(TIER / "memory.high")
    squeeze.set(Squeeze(tightening=1, step_bytes=64 * MIB, floor_bytes=64 * MIB,
                        reason="test"))
    loop.cycle(1.0)
    squeezed = read_int(TIER / "memory.high")
    assert squeezed < high
    assert read_int(TIER / "memory.max") == 256 * MIB  # v2: the squeeze is memory.high only
    squeeze.set(None)
    loop.cycle(2.0)
    assert read_int(TIER / "memory.high") == high
    assert [r["squeezed"] for r in sink.named("memory_guard_cap")] == [False, True, False]


# Holds 200 MiB of anonymous memory; on "grow" touches 128 MiB more and says so.
GROWER = (
    "import sys\n"
    "held = bytearray(200 << 20)\n"
    "for i in range(0, len(held), 4096): held[i] = 1\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "more = bytearray(128 << 20)\n"
    "for i in range(0, len(more), 4096): more[i] = 1\n"
    "print('grown', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_squeeze_throttling_anonymous_memory_holds_a_growing_job_and_kills_nothing(
        node: Node) -> None:
    cfg = standing(minimum_cap_bytes=768 * MIB, watermark_floor_bytes=1 << 40,
                   watermark_floor_percent=100.0)
    squeeze = GuardSqueeze()
    loop, _ = guard(cfg, squeeze)
    loop.cycle(0.0)
    high = read_int(TIER / "memory.high")
    cgroup, _ = node.container("besteffort", UID, CID)
    grower = node.spawn(cgroup, [sys.executable, "-I", "-c", GROWER], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
    assert grower.stdout is not None
    assert grower.stdin is not None
    assert grower.stdout.readline() == "ready\n"
    squeeze.set(Squeeze(64 * MIB, 64 * MIB, "test", 1, spare_anonymous=False))
    loop.cycle(1.0)
    throttled = read_int(TIER / "memory.high")
    anonymous = memory_stat(TIER)["anon"]
    assert throttled < anonymous  # below what no reclaim can take without swap
    before = read_int(TIER / "memory.current")
    grower.stdin.write("grow\n")
    grower.stdin.flush()
    # unthrottled, 128 MiB are touched in well under a second even under TCG
    assert select.select([grower.stdout], [], [], 5.0)[0] == [], "the job was not held"
    assert read_int(TIER / "memory.current") - before < 32 * MIB
    assert grower.poll() is None
    squeeze.set(None)  # released: memory.high back up, and the job goes on
    loop.cycle(2.0)
    assert read_int(TIER / "memory.high") == high
    assert select.select([grower.stdout], [], [], 60.0)[0], "the job did not go on"
    assert grower.stdout.readline() == "grown\n"
    events = dict(line.split() for line in (cgroup / "memory.events").read_text().splitlines())
    assert events["oom_kill"] == "0", events


def test_fulfillment_reads_the_cap_against_the_tiers_requests(node: Node) -> None:
    cfg = standing(minimum_cap_bytes=256 * MIB, watermark_floor_bytes=1 << 40,
                   watermark_floor_percent=100.0)
    loop, _ = guard(cfg)
    loop.cycle(0.0)
    _, cgroups_path = node.container("besteffort", UID, CID)
    # requests twice the cap: the tier cannot hold what its pods asked for
    state = one_pod(UID, "reclaimed_cores", CID, cgroups_path, 512 * MIB)
    sysfs = SysFs("/")
    board = Board()
    publisher = Publisher(board, AuditLog(MemoryAuditSink()), lambda: cfg.detection)
    detectors = DetectorsLoop(lambda: cfg, publisher, state, sysfs, probe_host(sysfs))
    for at in range(cfg.detection.entry_samples):
        detectors.cycle(float(at))
    [reading] = [r for r in board.current() if r.detector == "fulfillment"]
    assert reading.level > Level.NONE, reading
    assert str(256 * MIB) in reading.reason, reading


def test_a_node_full_of_page_cache_leaves_the_tier_what_was_not_requested(
        node: Node, tmp_path: Path) -> None:
    """An online pod that requested 600 MiB fills the node's free memory with page cache: the
    free-memory cap alone is the minimum (512 MiB), the guard's cap is allocatable (kubepods'
    1800 MiB) minus the request, and an offline pod of 700 MiB of anonymous memory runs."""
    (CGROUP / "kubepods/memory.max").write_text(str(1800 * MIB))
    online, _ = node.container("burstable", ONLINE_UID, ONLINE_CID)
    node.worker(online, CGROUP / "kubepods").ask(f"write {tmp_path / 'cache.bin'} 1400")
    loop, sink = guard(standing(), requests=600 * MIB)
    loop.cycle(0.0)
    [record] = sink.named("memory_guard_cap")
    assert record["target_bytes"] < 1200 * MIB - 256 * MIB, record  # free memory is gone
    assert read_int(TIER / "memory.max") == 1200 * MIB, record
    assert read_int(TIER / "memory.high") == 1200 * MIB  # not throttled below it either
    cgroup, _ = node.container("besteffort", UID, CID)
    holder = node.holder(cgroup, 700)
    assert holder.poll() is None
    events = dict(line.split() for line in (cgroup / "memory.events").read_text().splitlines())
    assert events["oom_kill"] == "0", events
