"""The refault detector: an online pod's working-set refaults from its ``memory.stat``, their
rate over a window, graded at its thresholds."""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest

from reconciler.detection import detectors as d
from reconciler.detection.config import DetectionConfig
from reconciler.detection.signals import Level
from reconciler.host.parse import ParseError

CFG = DetectionConfig()


@pytest.mark.parametrize(("v2", "text", "pages"), [
    (False, "workingset_refault_file 5\ntotal_workingset_refault_anon 3\n"
            "total_workingset_refault_file 40\n", 43),
    (True, "workingset_refault_anon 3\nworkingset_refault_file 40\n", 43),
    (True, "workingset_refault 41\n", 41),  # before Linux 5.9: one counter
    (False, "total_workingset_refault 41\n", 41),
    (True, "workingset_refault_file 40\n", 40)])
def test_refaults_from_memory_stat(v2: bool, text: str, pages: int) -> None:
    assert d.read_refaults("cache 0\n" + text, v2, 2.0) == d.Refaults(2.0, pages)


def test_refaults_missing_or_malformed_are_a_parse_error() -> None:
    # cgroup v1: the pod's own (non-hierarchical) counters do not count its containers'
    with pytest.raises(ParseError, match="no workingset_refault counters"):
        d.read_refaults("workingset_refault_file 40\n", False, 0.0)
    with pytest.raises(ParseError, match="no workingset_refault counters"):
        d.read_refaults("anon 5\n", True, 0.0)
    with pytest.raises(ParseError):
        d.read_refaults("workingset_refault_file forty\n", True, 0.0)


@pytest.mark.parametrize(("pages", "level"), [
    (5_119, Level.NONE), (5_120, Level.LOW), (51_199, Level.LOW), (51_200, Level.MEDIUM),
    (511_999, Level.MEDIUM), (512_000, Level.HIGH)])
def test_refault_rate_at_its_thresholds(pages: int, level: Level) -> None:
    """10 s window: 512, 5,120 and 51,200 pages a second."""
    sample = d.refault_sample("pod:web", [d.Refaults(0.0, 7), d.Refaults(10.0, 7 + pages)],
                              CFG, "web")
    assert sample is not None
    assert (sample.detector, sample.scope, sample.pod_uid, sample.unit) == (
        "refault", "pod:web", "web", "pages/s")
    assert (sample.value, sample.level) == (pages / 10, level)
    assert sample.thresholds == (512.0, 5120.0, 51200.0)


def test_refault_rate_over_its_window_a_reset_no_spike() -> None:
    # the burst before 5.0 is older than the 10 s window and does not count
    points = [d.Refaults(0.0, 0), d.Refaults(5.0, 10**6), d.Refaults(15.0, 10**6 + 6000)]
    sample = d.refault_sample("pod:web", points, CFG, "web")
    assert sample is not None
    assert (sample.value, sample.level) == (600.0, Level.LOW)
    # a pod cgroup made anew starts from 0
    sample = d.refault_sample("pod:web", [d.Refaults(0.0, 10**9), d.Refaults(1.0, 10),
                                          d.Refaults(2.0, 110)], CFG, "web")
    assert sample is not None
    assert sample.value == 100.0
    assert d.refault_sample("pod:web", [d.Refaults(0.0, 10**9), d.Refaults(1.0, 10)],
                            CFG, "web") is None


def test_refault_high_level_can_be_switched_off() -> None:
    cfg = dataclasses.replace(CFG, refault_high_pages_per_s=0.0)
    sample = d.refault_sample("pod:web", [d.Refaults(0.0, 0), d.Refaults(1.0, 10**9)],
                              cfg, "web")
    assert sample is not None
    assert sample.level is Level.MEDIUM


def test_the_history_keeps_what_the_window_needs() -> None:
    history = deque(d.Refaults(at, 0) for at in (0.0, 3.0, 5.0, 12.0, 14.0))
    d.keep_window(history, 15.0, 10.0)
    # 5.0 is the last sample at or before 15 - 10: the window's base
    assert [r.at for r in history] == [5.0, 12.0, 14.0]
    d.keep_window(history, 100.0, 10.0)
    assert [r.at for r in history] == [12.0, 14.0]  # never fewer than two
