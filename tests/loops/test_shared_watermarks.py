"""The loops that compare free memory with the zones' watermarks (the memory guard, NUMA binding,
NUMA balance, the periodic detectors) share one reading of ``/proc/zoneinfo`` a minute."""

from __future__ import annotations

from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from reconciler.detection.publisher import Publisher
from reconciler.detection.service import DetectorsLoop
from reconciler.detection.signals import Board
from reconciler.host.probe import probe_host
from reconciler.host.values import PAGE_SIZE
from reconciler.host.watermarks import Watermarks
from reconciler.runner import build_loops
from tests.support.counting import CountingSysFs
from tests.support.fakesys import GIB, MIB, FakeHost
from tests.support.guard_config import standing

OFFLINE = "11111111-0000-0000-0000-000000000001"
LOW = 1000  # pages: the guard's floor, not the zones' low watermark, decides
HIGH_LOW = 12 * GIB // 4096  # pages: a low watermark above the floor


def test_one_reading_a_minute_for_every_loop_and_the_guard_follows_it(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2)
    pod = host.add_pod(OFFLINE, tier="besteffort",
                       annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
    rel = pod.containers[0].rel
    (host.cg("", rel) / "memory.numa_stat").write_text(
        f"anon N0={512 * MIB} N1=0\nfile N0=0 N1=0\n")
    (host.cg("", rel) / "cpuset.mems").write_text("0\n")
    host.set_numa([(20 * GIB, 32 * GIB, LOW), (20 * GIB, 32 * GIB, LOW)])
    state = NodeState()
    state.replace_all(*host.nri())
    cfg = standing(max_step_bytes=64 * GIB, watermark_scale_factor=1.0,
                   floor_from_requests=False)
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = CountingSysFs(tmp_path, audit)
    host_info = probe_host(sysfs)
    marks = Watermarks(sysfs)
    loops = {loop.name: loop for loop in build_loops(lambda: cfg, state, sysfs, host_info,
                                                     None, audit, watermarks=marks)}
    publisher = Publisher(Board(), audit, lambda: cfg.detection)
    loops["detection"] = DetectorsLoop(lambda: cfg, publisher, state, sysfs, host_info,
                                       watermarks=marks)
    asking = ("memory_guard", "numa_binding", "numa_balance", "detection")
    limit = host.tier_dir("besteffort") / "memory.max"

    sysfs.clear()
    for now in (0.0, 10.0, 59.999):
        for name in asking:
            loops[name].cycle(now)
    assert sysfs.reads["/proc/zoneinfo"] == 1
    capped = int(limit.read_text())
    # 2 x (20 GiB free - the 3.2 GiB floor, 10 % of a node), in whole pages
    assert capped == 2 * (20 * GIB - int(32 * GIB * 0.1)) // PAGE_SIZE * PAGE_SIZE

    # The zones' low watermarks rise above the floor: seen at the next reading, a minute on.
    host.set_numa([(20 * GIB, 32 * GIB, HIGH_LOW), (20 * GIB, 32 * GIB, HIGH_LOW)])
    loops["memory_guard"].cycle(59.999)
    assert int(limit.read_text()) == capped
    loops["memory_guard"].cycle(60.0)
    assert sysfs.reads["/proc/zoneinfo"] == 2
    assert int(limit.read_text()) == 2 * (20 * GIB - 12 * GIB)
