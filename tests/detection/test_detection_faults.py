"""Detection against faults and clock readings: a per-pod detector that fails as a whole, a
cgroup v2 kernel with PSI off, and thresholds met exactly whatever the clock's origin."""

from __future__ import annotations

import dataclasses
import shutil
from collections import deque
from pathlib import Path
from typing import NoReturn

import pytest

from reconciler.detection import detectors as d
from reconciler.detection.config import DetectionConfig
from reconciler.detection.service import FAILED_PODS, DetectorsLoop
from reconciler.detection.signals import NODE, Level, pod_scope
from tests.support.detection_env import Setup, pod_pressure, uid
from tests.support.fakesys import GIB, MIB

CFG = DetectionConfig()


def broken(*args: object) -> NoReturn:
    raise RuntimeError("bug")


def test_a_failed_round_of_pod_psi_leaves_the_nodes_psi_and_goes_with_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup(tmp_path, version=2)
    web = s.pod("web", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    loop = s.loop()
    # the node's PSI path holds a level
    s.publisher.offer("psi", [d.psi_trigger_sample(NODE, 500, s.cfg.detection, 0.0)],
                      covers=None, triggered=True)
    # a fault of the detector itself: the pods' round fails
    (web / "memory.pressure").write_text(pod_pressure(0))
    monkeypatch.setattr(d, "read_stall", broken)
    loop.cycle(0.0)
    assert s.level("psi", NODE) is Level.LOW
    failed = s.reading("psi", FAILED_PODS)
    assert failed is not None
    assert failed.level is Level.UNKNOWN
    assert "RuntimeError" in failed.reason
    monkeypatch.undo()
    (web / "memory.pressure").write_text(pod_pressure(0))
    loop.cycle(1.0)
    assert s.reading("psi", FAILED_PODS) is None
    assert s.level("psi", NODE) is Level.LOW
    assert s.level("psi", pod_scope(uid("web"))) is None  # one reading: no rate yet
    (web / "memory.pressure").write_text(pod_pressure(0))
    loop.cycle(2.0)
    assert s.level("psi", pod_scope(uid("web"))) is Level.NONE


def test_a_failed_round_of_refaults_leaves_no_reading_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup(tmp_path, refaults=True)
    s.pod("web", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    loop = s.loop()
    monkeypatch.setattr(d, "read_refaults", broken)
    loop.cycle(0.0)
    assert s.level("refault", FAILED_PODS) is Level.UNKNOWN
    monkeypatch.undo()
    loop.cycle(1.0)
    assert {r.scope for r in s.board.current() if r.detector == "refault"} == set()
    loop.cycle(2.0)
    assert {r.scope for r in s.board.current() if r.detector == "refault"} == {
        pod_scope(uid("web"))}


def test_without_psi_a_v2_pod_has_no_psi_reading_and_nothing_unknown(tmp_path: Path) -> None:
    s = Setup(tmp_path, version=2)
    s.pod("web", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    shutil.rmtree(s.host.root / "proc/pressure")
    info = s.host_info()
    host = dataclasses.replace(info, psi=dataclasses.replace(info.psi, readable=False))
    assert not host.pod_psi
    loop = DetectorsLoop(lambda: s.cfg, s.publisher, s.state, s.sysfs, host)
    for t in range(3):
        loop.cycle(float(t))
    assert [r for r in s.board.current() if r.detector == "psi"] == []
    assert [r for r in s.sink.named("detector_unknown") if r["detector"] == "psi"] == []


ORIGINS = (1.0, 6.1, 6.4, 16.1, 1234.5, 98765.3)
"""Clock readings to start from: a difference of two of them is rarely the decimal one."""


@pytest.mark.parametrize("start", ORIGINS)
def test_a_stall_of_exactly_the_threshold_is_at_its_level(start: float) -> None:
    before = d.Stall(start, 0, 0)
    low = d.psi_sample(NODE, before, d.Stall(start + 0.1, 10_000, 0), CFG)
    assert low is not None
    assert (low.level, low.value) == (Level.LOW, 10.0)
    high = d.psi_sample(NODE, before, d.Stall(start + 0.1, 30_000, 50_000), CFG)
    assert high is not None
    assert high.level is Level.HIGH


@pytest.mark.parametrize("start", ORIGINS)
def test_a_rate_of_exactly_the_threshold_is_at_its_level(start: float) -> None:
    refaults = d.refault_sample("pod:u", [d.Refaults(start, 0), d.Refaults(start + 10, 5120)],
                                CFG, "u")
    assert refaults is not None
    assert (refaults.level, refaults.value) == (Level.LOW, 512.0)
    kswapd = d.kswapd_sample([d.Reclaim(start, 0, 0), d.Reclaim(start + 10, 20_000, 0)], CFG)
    assert kswapd is not None
    assert (kswapd.level, kswapd.value) == (Level.LOW, 2000.0)


@pytest.mark.parametrize("start", ORIGINS)
def test_a_sample_exactly_a_window_old_is_the_rates_base(start: float) -> None:
    history = deque([d.Refaults(start - 1, 0), d.Refaults(start, 0),
                     d.Refaults(start + 10, 5120)])
    sample = d.refault_sample("pod:u", list(history), CFG, "u")
    assert sample is not None
    assert (sample.level, sample.value) == (Level.LOW, 512.0)
    d.keep_window(history, start + 10, CFG.refault_window_s)
    assert [r.at for r in history] == [start, start + 10]
