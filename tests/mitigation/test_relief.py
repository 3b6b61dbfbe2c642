"""Judging a squeeze, pure: the pod's counters (PSI some and full, v1 and v2 refaults), the rate
over the squeeze, the verdict at its exact threshold, and what cannot be judged."""

from __future__ import annotations

import pytest

from reconciler.detection.config import KSWAPD, PSI, REFAULT
from reconciler.detection.signals import Level, Reading, pod_scope
from reconciler.host.parse import ParseError
from reconciler.mitigation import relief

UID = "web-0000-4000-8000-000000000000"


def pressure(some_us: int, full_us: int | None = None) -> str:
    text = f"some avg10=0.00 avg60=0.00 avg300=0.00 total={some_us}\n"
    if full_us is not None:
        text += f"full avg10=0.00 avg60=0.00 avg300=0.00 total={full_us}\n"
    return text


def reading(detector: str, value: float, level: Level = Level.LOW,
            uid: str | None = UID) -> Reading:
    unit = "percent" if detector == PSI else "pages/s"
    return Reading(detector, pod_scope(uid or "x"), level, value, 10.0, unit, "test", uid)


def test_only_a_pods_own_reading_is_judged() -> None:
    assert relief.judged(reading(PSI, 20.0))
    assert relief.judged(reading(REFAULT, 600.0))
    assert not relief.judged(reading(PSI, 20.0, uid=None))  # the node's PSI
    assert not relief.judged(reading(KSWAPD, 9000.0))
    assert not relief.judged(None)


def test_psi_some_share_over_the_squeeze() -> None:
    start = relief.mark(reading(PSI, 20.0), pressure(1_000_000, 10), v2=True, at=100.0)
    assert (start.counter, start.full, start.file) == (1_000_000, False, "memory.pressure")
    # 1.5 s stalled in 15 s: 10 %
    assert relief.during(start, pressure(2_500_000, 10), v2=True, now=115.0) == \
        pytest.approx(10.0)


def test_psi_at_level_high_judges_the_full_share() -> None:
    start = relief.mark(reading(PSI, 60.0, Level.HIGH), pressure(5, 1_000_000), True, 0.0)
    assert start.full
    assert relief.during(start, pressure(9_000_000, 4_000_000), True, 10.0) == \
        pytest.approx(30.0)
    with pytest.raises(ParseError, match="no 'full' line"):
        relief.during(start, pressure(9_000_000), True, 10.0)


@pytest.mark.parametrize(("stat", "v2"), [
    ("total_workingset_refault_anon 100\ntotal_workingset_refault_file 900\n", False),
    ("workingset_refault_anon 100\nworkingset_refault_file 900\n", True),
    ("total_workingset_refault 1000\n", False),
])
def test_refault_rate_over_the_squeeze(stat: str, v2: bool) -> None:
    start = relief.mark(reading(REFAULT, 600.0), stat, v2, at=0.0)
    assert (start.counter, start.file) == (1000, "memory.stat")
    later = stat.replace("900", "3900").replace("1000", "4000")
    assert relief.during(start, later, v2, now=15.0) == pytest.approx(200.0)


def test_a_counter_that_went_back_or_no_time_gives_no_rate() -> None:
    start = relief.mark(reading(PSI, 20.0), pressure(1_000_000), True, 10.0)
    assert relief.during(start, pressure(999_999), True, 20.0) is None  # cgroup made anew
    assert relief.during(start, pressure(2_000_000), True, 10.0) is None


@pytest.mark.parametrize("text", ["", "garbage\n", "rss 5\n"])
def test_unreadable_counters_are_parse_errors(text: str) -> None:
    with pytest.raises(ParseError):
        relief.mark(reading(REFAULT if text.startswith("rss") else PSI, 20.0), text, True, 0.0)


def test_relieved_at_exactly_the_minimum_relief() -> None:
    assert relief.relieved(20.0, 15.0, 25.0)
    assert not relief.relieved(20.0, 15.001, 25.0)
    assert relief.relieved(20.0, 20.0, 0.0)  # 0 %: any squeeze that did not make it worse
    assert not relief.relieved(20.0, 0.001, 100.0)
    assert relief.relieved(20.0, 0.0, 100.0)


def test_the_verdict_says_what_was_compared() -> None:
    start = relief.mark(reading(PSI, 20.0), pressure(0), True, 0.0)
    text = relief.verdict_text(start, 18.0, False, 25.0, 15.0)
    assert text == (f"psi of pod {UID} 20 percent when the squeeze began, 18 percent over its "
                    "15 s (above 15 percent: 25 % less)")
