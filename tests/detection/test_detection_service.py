"""Detection end to end on fake trees: files read, samples smoothed, readings published, unknowns
audited once, pods coming and going, the PSI poll, the whole service starting and stopping."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog
from reconciler.detection.detectors import RECLAIMED_TIER
from reconciler.detection.notified import NodePsi
from reconciler.detection.service import Detection, DetectorsLoop
from reconciler.detection.signals import (
    NODE,
    Level,
    numa_scope,
    pod_scope,
    tier_scope,
)
from reconciler.host.watermarks import MAX_AGE_S
from tests.support.counting import CountingSysFs
from tests.support.detection_env import Setup, uid
from tests.support.fakesys import GIB, MIB, PAGE
from tests.support.polling import BOUND_S, eventually


def test_free_memory_levels_need_two_samples(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    loop = s.loop()
    loop.cycle(0.0)
    assert s.level("system_free", NODE) is Level.NONE
    assert s.level("numa_free", numa_scope(0)) is Level.NONE
    # node 1 falls under its 1 GiB floor (its zones' low watermark is only 4 MB)
    s.host.set_numa([(40 * GIB, 64 * GIB, 1000), (GIB - MIB, 64 * GIB, 1000)])
    loop.cycle(1.0)
    assert s.level("numa_free", numa_scope(1)) is Level.NONE  # one sample does not act
    loop.cycle(2.0)
    assert s.level("numa_free", numa_scope(1)) is Level.MEDIUM
    assert s.level("system_free", NODE) is Level.NONE  # 41 GB free against 2 x 1 GiB


@pytest.mark.parametrize("disabled", [(), ("system_free",), ("numa_free",)])
def test_watermarks_are_read_once_a_minute(tmp_path: Path, disabled: tuple[str, ...]) -> None:
    assert MAX_AGE_S == 60.0
    s = Setup(tmp_path, disabled=disabled)
    counting = CountingSysFs(tmp_path, AuditLog(s.sink))
    loop = DetectorsLoop(lambda: s.cfg, s.publisher, s.state, counting, s.host_info())
    for t in range(2):
        loop.cycle(float(t))
    assert counting.reads["/proc/zoneinfo"] == 1
    # node 1 falls under its 1 GiB floor: numa_free sees it from its meminfo, system_free not
    s.host.set_numa([(40 * GIB, 64 * GIB, 1000), (GIB - MIB, 64 * GIB, 1000)])
    counting.clear()
    for later in (2.0, 59.999):
        loop.cycle(later)
    assert counting.reads["/proc/zoneinfo"] == 0
    assert counting.reads["/proc/sys/vm/watermark_scale_factor"] == 0
    assert counting.listed["/sys/devices/system/node"] == 0
    assert counting.reads["/sys/devices/system/node/node1/meminfo"] == (
        0 if "numa_free" in disabled else 2)
    expected = {("system_free", NODE): Level.NONE, ("numa_free", numa_scope(0)): Level.NONE,
                ("numa_free", numa_scope(1)): Level.MEDIUM}
    assert {key: s.level(*key) for key in expected} == {
        key: None if key[0] in disabled else level for key, level in expected.items()}
    loop.cycle(60.0)  # a minute after they were read: again, once
    assert counting.reads["/proc/zoneinfo"] == 1
    assert counting.reads["/proc/sys/vm/watermark_scale_factor"] == 1
    assert counting.listed["/sys/devices/system/node"] == 1


def test_a_watermark_changed_counts_from_its_next_reading(tmp_path: Path) -> None:
    s = Setup(tmp_path, entry_samples=1)
    loop = s.loop()
    loop.cycle(0.0)
    # node 1: 3 GiB free; its zones' low watermark raised to 4 GiB (x free_zone_low_factor 1)
    low = 4 * GIB // PAGE
    s.host.set_numa([(40 * GIB, 64 * GIB, 1000), (3 * GIB, 64 * GIB, low)])
    loop.cycle(59.0)
    assert s.level("numa_free", numa_scope(1)) is Level.NONE  # 3 GiB against 2 x 1 GiB
    loop.cycle(60.0)
    assert s.level("numa_free", numa_scope(1)) is Level.MEDIUM  # under its low watermark


def test_without_zoneinfo_both_free_memory_detectors_are_unknown(tmp_path: Path) -> None:
    s = Setup(tmp_path, entry_samples=1)
    zoneinfo = s.host.root / "proc/zoneinfo"
    text = zoneinfo.read_text()
    zoneinfo.unlink()
    loop = s.loop()
    for t in range(2):
        loop.cycle(float(t))
    reasons = {(r["detector"], r["scope"]): r["reason"] for r in s.sink.named("detector_unknown")}
    assert reasons == {
        ("system_free", NODE): "/proc/zoneinfo is missing",
        ("numa_free", numa_scope(0)): "/proc/zoneinfo is missing",
        ("numa_free", numa_scope(1)): "/proc/zoneinfo is missing",
    }
    assert len(s.sink.named("detector_unknown")) == 3  # audited once each
    assert s.level("system_free", NODE) is Level.UNKNOWN
    assert s.level("numa_free", numa_scope(1)) is Level.UNKNOWN
    counting = CountingSysFs(s.host.root, AuditLog(s.sink))
    looking = DetectorsLoop(lambda: s.cfg, s.publisher, s.state, counting, s.host_info())
    looking.cycle(0.0)
    looking.cycle(1.0)
    assert counting.reads["/proc/zoneinfo"] == 2  # once a cycle, by whichever detector is first
    # back: read at the next cycle, not a minute later
    zoneinfo.write_text(text)
    loop.cycle(2.0)
    assert s.level("system_free", NODE) is Level.NONE
    assert s.level("numa_free", numa_scope(1)) is Level.NONE


def test_a_zoneinfo_not_understood_makes_both_unknown_and_is_read_again(tmp_path: Path) -> None:
    s = Setup(tmp_path, entry_samples=1)
    zoneinfo = s.host.root / "proc/zoneinfo"
    text = zoneinfo.read_text()
    loop = s.loop()  # the agent started on a kernel whose file it understood
    zoneinfo.write_text(re.sub(r"(?m)^\s+low\s+\d+\n", "", text))
    loop.cycle(0.0)
    reasons = {(r["detector"], r["scope"]): r["reason"] for r in s.sink.named("detector_unknown")}
    assert set(reasons) == {("system_free", NODE), ("numa_free", numa_scope(0)),
                            ("numa_free", numa_scope(1))}
    assert all("lacks low" in reason for reason in reasons.values()), reasons
    zoneinfo.write_text(text)
    loop.cycle(1.0)
    assert s.level("system_free", NODE) is Level.NONE


def test_kswapd_rate_from_the_counters(tmp_path: Path) -> None:
    s = Setup(tmp_path, kswapd_window_s=2.0)
    loop = s.loop()
    for i in range(4):
        s.vmstat(i * 5000)  # 5000 pages/s
        loop.cycle(float(i))
    reading = s.reading("kswapd", NODE)
    assert reading is not None
    assert reading.value == 5000
    assert reading.level is Level.LOW
    s.vmstat(3)  # the counter went back (a reset): no spike, the history starts again
    loop.cycle(4.0)
    assert s.reading("kswapd", NODE).value == 5000  # type: ignore[union-attr]


def test_rss_overuse_per_pod_with_annotations(tmp_path: Path) -> None:
    s = Setup(tmp_path, entry_samples=1)
    s.pod("over", "reclaimed_cores", request=100 * MIB, anon=105 * MIB)  # exactly 1.05 x
    s.pod("under", "shared_cores", request=100 * MIB, anon=104 * MIB, tier="burstable")
    s.pod("strict", "shared_cores", request=100 * MIB, anon=101 * MIB, tier="burstable",
          annotations={"nri-qos.io/rss-overuse-factor": "1.01"})
    s.pod("loose", "reclaimed_cores", request=100 * MIB, anon=106 * MIB,
          annotations={"nri-qos.io/rss-overuse-factor": "2.0"})
    s.pod("online", "dedicated_cores", request=100 * MIB, anon=500 * MIB, tier="guaranteed")
    s.pod("norequest", "reclaimed_cores", request=0, anon=500 * MIB)
    loop = s.loop()
    with capture_logs() as logs:
        loop.cycle(0.0)
        loop.cycle(1.0)
    levels = {r.pod_uid: r.level for r in s.board.current() if r.detector == "rss_overuse"}
    assert levels == {uid("over"): Level.HIGH, uid("under"): Level.LOW,
                      uid("strict"): Level.HIGH, uid("loose"): Level.HIGH}
    ignored = [e for e in logs if e["event"] == "rss_overuse_annotation_ignored"]
    assert len(ignored) == 1
    assert "not stricter" in ignored[0]["reason"]
    strict = s.reading("rss_overuse", pod_scope(uid("strict")))
    assert strict is not None
    assert strict.threshold == pytest.approx(101 * MIB)
    # a pod that goes away takes its reading with it
    s.host.pods = [p for p in s.host.pods if p.info.name != "over"]
    s.state.replace_all(*s.host.nri())
    loop.cycle(2.0)
    assert s.reading("rss_overuse", pod_scope(uid("over"))) is None


def test_fulfillment_of_the_reclaimed_tier(tmp_path: Path) -> None:
    s = Setup(tmp_path, entry_samples=1)
    s.pod("a", "reclaimed_cores", request=GIB, anon=MIB)
    s.pod("b", "reclaimed_cores", request=GIB, anon=MIB)
    s.pod("web", "shared_cores", request=10 * GIB, anon=MIB, tier="burstable")
    loop = s.loop()
    loop.cycle(0.0)
    assert s.reading("fulfillment", RECLAIMED_TIER) is None  # the tier has no cap
    (s.host.tier_dir("besteffort") / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    loop.cycle(1.0)
    reading = s.reading("fulfillment", RECLAIMED_TIER)
    assert reading is not None
    assert (reading.value, reading.level) == (0.5, Level.MEDIUM)


def test_unknown_is_audited_once_per_cause_and_recovers(tmp_path: Path) -> None:
    s = Setup(tmp_path, entry_samples=1)
    loop = s.loop()
    meminfo = s.host.root / "proc/meminfo"
    good = meminfo.read_text()
    meminfo.write_text(good[:20])  # truncated in the middle of MemTotal's line: no MemFree
    for t in range(3):
        loop.cycle(float(t))
    assert s.level("system_free", NODE) is Level.UNKNOWN
    [audited] = s.sink.named("detector_unknown")
    assert audited == {"detector": "system_free", "scope": NODE,
                       "reason": "/proc/meminfo lacks MemFree"}
    meminfo.write_text("MemTotal: lots kB\n")  # another cause: audited again
    loop.cycle(3.0)
    assert len(s.sink.named("detector_unknown")) == 2
    meminfo.write_text(good)
    loop.cycle(4.0)
    assert s.level("system_free", NODE) is Level.NONE
    meminfo.write_text("")  # the same cause again after a recovery: audited again
    loop.cycle(5.0)
    assert len(s.sink.named("detector_unknown")) == 3


def test_a_missing_file_is_unknown_not_calm(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    (s.host.root / "proc/vmstat").unlink()
    s.loop().cycle(0.0)
    reading = s.reading("kswapd", NODE)
    assert reading is not None
    assert reading.level is Level.UNKNOWN
    assert reading.reason == "/proc/vmstat is missing"


def test_a_detector_that_raises_spares_the_others(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup(tmp_path)
    loop = s.loop()

    def broken(cfg: Any, now: float) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(loop, "_kswapd", broken)
    loop.cycle(0.0)
    assert s.level("kswapd", NODE) is Level.UNKNOWN
    assert "RuntimeError" in s.reading("kswapd", NODE).reason  # type: ignore[union-attr]
    assert s.level("system_free", NODE) is Level.NONE


def test_disabled_detectors_withdraw_their_readings(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    loop = s.loop()
    loop.cycle(0.0)
    assert s.reading("system_free", NODE) is not None
    s.cfg = dataclasses.replace(s.cfg, detection=dataclasses.replace(
        s.cfg.detection, disabled=("system_free",)))
    loop.cycle(1.0)
    assert s.reading("system_free", NODE) is None
    assert s.reading("numa_free", numa_scope(0)) is not None


def test_v2_online_pods_psi(tmp_path: Path) -> None:
    s = Setup(tmp_path, version=2)
    web = s.pod("web", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    batch = s.pod("batch", "reclaimed_cores", request=GIB, anon=MIB)
    for d in (web, batch):
        (d / "memory.pressure").write_text("some avg10=0 avg60=0 avg300=0 total=0\n"
                                           "full avg10=0 avg60=0 avg300=0 total=0\n")
    loop = s.loop()
    for t in range(3):
        total = t * 400_000  # 40 % of each second stalled
        for d in (web, batch):
            (d / "memory.pressure").write_text(f"some avg10=0 avg60=0 avg300=0 total={total}\n"
                                               "full avg10=0 avg60=0 avg300=0 total=0\n")
        loop.cycle(float(t))
    reading = s.reading("psi", pod_scope(uid("web")))
    assert reading is not None
    assert reading.level is Level.MEDIUM
    assert reading.value == 40.0
    assert reading.pod_uid == uid("web")
    assert s.reading("psi", pod_scope(uid("batch"))) is None  # reclaimed pods: not online


def test_v1_has_no_pod_psi(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.pod("web", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    s.loop().cycle(0.0)
    assert [r for r in s.board.current() if r.detector == "psi"] == []


def test_v1_online_pods_refaults(tmp_path: Path) -> None:
    s = Setup(tmp_path, refaults=True)
    web = s.pod("web", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    batch = s.pod("batch", "reclaimed_cores", request=GIB, anon=MIB)
    loop = s.loop()
    for t in range(3):
        for d in (web, batch):
            s.refaults(d, t * 600)  # 600 pages a second read again
        loop.cycle(float(t))
        if t == 1:  # one rate: one sample does not enter a level
            assert s.level("refault", pod_scope(uid("web"))) is Level.NONE
    reading = s.reading("refault", pod_scope(uid("web")))
    assert reading is not None
    assert (reading.level, reading.value, reading.threshold, reading.unit) == (
        Level.LOW, 600.0, 512.0, "pages/s")
    assert reading.pod_uid == uid("web")
    assert s.reading("refault", pod_scope(uid("batch"))) is None  # reclaimed pods: not online
    assert [r for r in s.board.current() if r.detector == "psi"] == []
    # the pod's memory.stat gone: unknown, with the reason
    (web / "memory.stat").unlink()
    loop.cycle(3.0)
    assert s.level("refault", pod_scope(uid("web"))) is Level.UNKNOWN
    assert s.reading("refault", pod_scope(uid("web"))).reason == (  # type: ignore[union-attr]
        "memory.stat is gone")


def test_a_pods_memory_stat_is_read_once_a_cycle(tmp_path: Path) -> None:
    """RSS overuse and refaults both want a shared_cores pod's memory.stat: one read serves."""
    s = Setup(tmp_path, refaults=True)
    web = s.pod("web", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    counting = CountingSysFs(tmp_path, AuditLog(s.sink))
    loop = DetectorsLoop(lambda: s.cfg, s.publisher, s.state, counting, s.host_info())
    stat = f"/{web.relative_to(tmp_path)}/memory.stat"
    for t in range(2):
        s.refaults(web, t * 6000)
        loop.cycle(float(t))
        assert counting.reads[stat] == t + 1
    assert s.reading("rss_overuse", pod_scope(uid("web"))) is not None
    assert s.reading("refault", pod_scope(uid("web"))) is not None


@pytest.mark.parametrize(("version", "refaults", "why"), [
    (2, True, "refault is off: each online pod's PSI counts its stalls on refaults"),
    (1, False, "refault is off: memory.stat has no workingset_refault counters (Linux 5.9+)")])
def test_refaults_are_read_only_where_pods_have_no_psi_and_the_kernel_counts_them(
        tmp_path: Path, version: int, refaults: bool, why: str) -> None:
    s = Setup(tmp_path, version, refaults=refaults)
    web = s.pod("web", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    loop = s.loop()
    with capture_logs() as logs:
        for t in range(3):
            s.refaults(web, t * 100_000)
            loop.cycle(float(t))
    assert [r for r in s.board.current() if r.detector == "refault"] == []
    assert [e["reason"] for e in logs if e["event"] == "detector_unavailable"
            and e["detector"] == "refault"] == [why]


async def test_node_psi_poll_enters_and_leaves(tmp_path: Path) -> None:
    s = Setup(tmp_path, psi_poll_interval_ms=20, exit_cooldown_s=0.2)
    host = dataclasses.replace(s.host_info(), psi=dataclasses.replace(
        s.host_info().psi, system=dataclasses.replace(s.host_info().psi.system,
                                                      window_us=2_000_000)))
    psi = NodePsi(lambda: s.cfg, s.publisher, s.sysfs, host)
    stop = asyncio.Event()
    task = asyncio.create_task(psi.run(stop))
    stalled = asyncio.Event()
    await eventually(lambda: s.level("psi", NODE) is Level.NONE)
    assert psi.mode == "poll"  # 2 s windows only: too slow, so the counter is polled
    staller = asyncio.create_task(s.stall(stalled))
    await eventually(lambda: s.level("psi", NODE) is Level.HIGH)
    stalled.set()
    await staller
    await eventually(lambda: s.level("psi", NODE) is Level.NONE)
    stop.set()
    await asyncio.wait_for(task, BOUND_S)


async def test_node_psi_falls_back_to_the_poll_when_the_trigger_cannot_be_armed(
        tmp_path: Path) -> None:
    s = Setup(tmp_path, psi_poll_interval_ms=20)
    info = s.host_info()
    # a plain file accepts the trigger's text, as the probe saw, but cannot be polled
    assert info.psi.system.window_us == 500_000
    psi = NodePsi(lambda: s.cfg, s.publisher, s.sysfs, info)
    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(psi.run(stop))
        await eventually(lambda: s.reading("psi", NODE) is not None)
    assert psi.mode == "poll"
    assert any(e["event"] == "psi_path" and "arming the trigger failed" in e["reason"]
               for e in logs)
    stop.set()
    await asyncio.wait_for(task, BOUND_S)


async def test_node_psi_unreadable_is_unknown_then_off_without_psi(tmp_path: Path) -> None:
    s = Setup(tmp_path, psi_poll_interval_ms=20)
    host = dataclasses.replace(s.host_info(), psi=dataclasses.replace(
        s.host_info().psi, system=dataclasses.replace(s.host_info().psi.system,
                                                      window_us=None)))
    (s.host.root / "proc/pressure/memory").write_text("some total=\n")
    psi = NodePsi(lambda: s.cfg, s.publisher, s.sysfs, host)
    stop = asyncio.Event()
    task = asyncio.create_task(psi.run(stop))
    await eventually(lambda: s.level("psi", NODE) is Level.UNKNOWN)
    stop.set()
    await asyncio.wait_for(task, BOUND_S)
    off = dataclasses.replace(host, psi=dataclasses.replace(host.psi, readable=False))
    psi_off = NodePsi(lambda: s.cfg, s.publisher, s.sysfs, off)
    stop2 = asyncio.Event()
    task2 = asyncio.create_task(psi_off.run(stop2))
    await asyncio.sleep(0.05)
    assert psi_off.mode == "off"
    stop2.set()
    await asyncio.wait_for(task2, BOUND_S)


async def test_pressure_level_registration_refused_spares_the_other_cgroups(
        tmp_path: Path) -> None:
    s = Setup(tmp_path, interval_s=0.02, quiet_interval_s=0.02)
    levels = s.memcg_events()
    control = s.host.cg("memory", "kubepods") / "cgroup.event_control"
    control.unlink()
    control.mkdir()  # the registration's write cannot be made (EISDIR)
    guaranteed, burstable = tier_scope("kubepods"), tier_scope("burstable")
    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(levels.run(stop))
        try:
            await eventually(lambda: s.reading("pressure_level", NODE) is not None
                             and s.reading("pressure_level", burstable) is not None)
            await asyncio.sleep(0.1)  # a few more periods: the refusal is said once
            assert s.reading("pressure_level", guaranteed) is None
            assert set(levels.targets) - set(levels._watches) == {guaranteed}
            refused = [e for e in logs if e["event"] == "pressure_level_unavailable"]
            assert len(refused) == 1
            assert refused[0]["reason"].startswith("IsADirectoryError")
            # the cgroup takes registrations again: watched from the next period on
            control.rmdir()
            control.write_text("")
            await eventually(lambda: s.reading("pressure_level", guaranteed) is not None)
        finally:
            stop.set()
            await asyncio.wait_for(task, BOUND_S)


async def test_pressure_level_watch_of_a_removed_cgroup_ends(tmp_path: Path) -> None:
    s = Setup(tmp_path, interval_s=0.02, quiet_interval_s=0.02)
    levels = s.memcg_events()
    burstable = tier_scope("burstable")
    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(levels.run(stop))
        try:
            await eventually(lambda: s.reading("pressure_level", burstable) is not None)
            fds = list(levels._watches[burstable].fds.values())
            shutil.rmtree(s.host.cg("memory", "kubepods/burstable"))
            for fd in fds:  # as the kernel signals every registration when the cgroup goes
                os.eventfd_write(fd, 1)
            await eventually(lambda: s.reading("pressure_level", burstable) is None)
            await asyncio.sleep(0.1)  # a few more periods: not registered again
            assert s.reading("pressure_level", burstable) is None
            assert burstable not in levels._watches
            assert s.level("pressure_level", NODE) is Level.NONE
            assert [e["cgroup"] for e in logs
                    if e["event"] == "pressure_level_watch_ended"] == [
                "/sys/fs/cgroup/memory/kubepods/burstable"]
        finally:
            stop.set()
            await asyncio.wait_for(task, BOUND_S)


async def test_the_service_runs_every_path_and_clears_the_board_at_stop(tmp_path: Path) -> None:
    s = Setup(tmp_path, interval_s=0.05, quiet_interval_s=0.05, psi_poll_interval_ms=20)
    detection = Detection(lambda: s.cfg, s.board, s.state, s.sysfs, s.host_info(),
                          AuditLog(s.sink))
    stop = asyncio.Event()
    task = asyncio.create_task(detection.run(stop))
    await eventually(lambda: {"system_free", "numa_free", "psi", "kswapd"} <= {
        r.detector for r in s.board.current()})
    stop.set()
    await asyncio.wait_for(task, BOUND_S)
    assert s.board.current() == ()
    # pressure_level is unavailable on a fake tree (no memory.pressure_level in the root memcg)
    assert not s.host_info().memcg.pressure_level


def test_page_size_of_the_fakes_matches_the_kernels() -> None:
    assert PAGE == 4096
