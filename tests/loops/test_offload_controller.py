"""Offloading's pure controller at its exact thresholds: the step, backing off, the budget, who is
eligible, and the counters read from memory.stat and memory.pressure."""

from __future__ import annotations

import dataclasses

import pytest

from reconciler.host.parse import ParseError
from reconciler.host.values import PAGE_SIZE
from reconciler.loops.offload import (
    FAST_GROW,
    FIRST,
    GROW,
    MIN_PERCENT,
    REFAULT,
    SCAN,
    STALL,
    Counters,
    OffloadConfig,
    Track,
    anon_allowed,
    budget,
    decide,
    eligible,
    parse_counters,
    share,
)
from tests.support.fakesys import MIB
from tests.support.offload import GIB, INACTIVE, PRESSURE, pages, stat_text

CFG = OffloadConfig(enabled=True)


def counters(*, stall: int = 0, scan: int = 0, steal: int = 0, refault: int = 0,
             inactive_file: int = INACTIVE, inactive_anon: int = 0) -> Counters:
    return Counters(stall, scan, steal, refault, inactive_file, inactive_anon)


# -- the controller ------------------------------------------------------------------------------


def test_a_first_cycle_only_reads_then_the_first_step_asks_the_initial_share() -> None:
    first = decide(CFG, None, 0.0, counters(), anon=False)
    assert (first.ask, first.verdict, first.percent) == (0, FIRST, 5.0)
    track = Track(0.0, counters(), first.percent)
    step = decide(CFG, track, 5.0, counters(), anon=False)
    assert (step.verdict, step.percent, step.ask) == (GROW, 5.0, pages(50 * MIB))


def test_the_step_grows_by_5_percent_or_10_when_the_kernel_gave_all_it_was_asked() -> None:
    asked = 50 * MIB
    short = Track(0.0, counters(), 5.0, asked=asked, reclaimed=asked - PAGE_SIZE)
    grow = decide(CFG, short, 5.0, counters(steal=(asked - PAGE_SIZE) // PAGE_SIZE), anon=False)
    assert (grow.verdict, grow.percent, grow.ask) == (GROW, 10.0, pages(100 * MIB))
    full = Track(0.0, counters(), 5.0, asked=asked, reclaimed=asked)
    fast = decide(CFG, full, 5.0, counters(steal=asked // PAGE_SIZE), anon=False)
    assert (fast.verdict, fast.percent, fast.ask) == (FAST_GROW, 15.0, pages(150 * MIB))
    # all it asked, but one refault: the slower growth
    one = decide(CFG, full, 5.0, counters(steal=asked // PAGE_SIZE, refault=1), anon=False)
    assert (one.verdict, one.percent) == (GROW, 10.0)


def test_the_step_never_asks_more_than_its_share_or_its_bytes() -> None:
    full = Track(0.0, counters(), 45.0, asked=MIB, reclaimed=MIB)
    capped = decide(CFG, full, 5.0, counters(steal=MIB // PAGE_SIZE), anon=False)
    assert capped.percent == 50.0
    assert capped.ask == CFG.max_step_bytes  # 50 % of 1000 MiB is above 256 MiB
    small = decide(CFG, full, 5.0, counters(steal=MIB // PAGE_SIZE, inactive_file=400 * MIB),
                   anon=False)
    assert small.ask == pages(200 * MIB)


def test_a_step_under_min_step_bytes_is_not_taken_one_exactly_at_it_is() -> None:
    track = Track(0.0, counters(), 5.0)
    at = decide(CFG, track, 5.0, counters(inactive_file=20 * MIB), anon=False)  # 5 % = 1 MiB
    assert at.ask == MIB
    under = decide(CFG, track, 5.0, counters(inactive_file=20 * MIB - 20 * PAGE_SIZE),
                   anon=False)
    assert under.ask == 0


def test_stall_above_its_share_of_the_interval_backs_off_at_it_does_not() -> None:
    track = Track(0.0, counters(), 20.0, asked=MIB, reclaimed=MIB)
    limit = int(CFG.max_stall_percent / 100 * 1_000_000 * 5)  # 25 ms of stall in 5 s
    held = decide(CFG, track, 5.0, counters(stall=limit, steal=MIB // PAGE_SIZE), anon=False)
    assert held.verdict == FAST_GROW
    assert held.ask > 0
    backed = decide(CFG, track, 5.0, counters(stall=limit + 1, steal=MIB // PAGE_SIZE),
                    anon=False)
    assert (backed.verdict, backed.ask, backed.percent) == (STALL, 0, 10.0)
    assert backed.stall_us_per_s == pytest.approx((limit + 1) / 5)


def test_refaults_above_one_minus_accuracy_back_off_at_it_they_do_not() -> None:
    track = Track(0.0, counters(), 20.0, asked=MIB, reclaimed=0)
    at = decide(CFG, track, 5.0, counters(steal=1000, refault=100), anon=False)  # 10 %
    assert at.verdict == GROW
    assert at.refault_ratio == pytest.approx(0.1)
    over = decide(CFG, track, 5.0, counters(steal=1000, refault=101), anon=False)
    assert (over.verdict, over.ask, over.percent) == (REFAULT, 0, 10.0)
    # refaults with nothing reclaimed: the memory is in use
    nothing = decide(CFG, track, 5.0, counters(refault=1), anon=False)
    assert nothing.verdict == REFAULT


def test_scan_efficiency_under_its_share_halves_the_step_but_takes_it() -> None:
    track = Track(0.0, counters(), 20.0, asked=MIB, reclaimed=0)
    at = decide(CFG, track, 5.0, counters(scan=100, steal=50), anon=False)
    assert at.verdict == GROW
    under = decide(CFG, track, 5.0, counters(scan=100, steal=49), anon=False)
    assert (under.verdict, under.percent, under.ask) == (SCAN, 10.0, pages(100 * MIB))


def test_backing_off_never_goes_under_the_minimum_share() -> None:
    track = Track(0.0, counters(), 1.5, asked=MIB, reclaimed=MIB)
    backed = decide(CFG, track, 5.0, counters(stall=10**9), anon=False)
    assert backed.percent == MIN_PERCENT == 1.0


def test_anonymous_memory_is_in_the_base_only_where_allowed() -> None:
    track = Track(0.0, counters(), 5.0)
    now = counters(inactive_file=100 * MIB, inactive_anon=900 * MIB)
    assert decide(CFG, track, 5.0, now, anon=False).base == 100 * MIB
    assert decide(CFG, track, 5.0, now, anon=True).base == 1000 * MIB


def test_anonymous_offloading_needs_the_setting_swap_and_a_swap_max_that_is_not_zero() -> None:
    on = dataclasses.replace(CFG, anon=True)
    assert anon_allowed(on, GIB, "max\n")
    assert anon_allowed(on, GIB, None)  # no per-cgroup swap limit
    assert not anon_allowed(on, GIB, "0\n")
    assert not anon_allowed(on, 0, "max\n")  # no swap: the kernel cannot reclaim anon
    assert not anon_allowed(CFG, GIB, "max\n")  # off by default


def test_the_budget_is_the_rate_over_the_time_since_the_last_cycle_at_most_a_period() -> None:
    cfg = dataclasses.replace(CFG, max_bytes_per_s=10 * MIB, interval_s=5.0)
    assert budget(cfg, None) == 50 * MIB
    assert budget(cfg, 2.0) == 20 * MIB
    assert budget(cfg, 60.0) == 50 * MIB


def test_the_budget_goes_to_the_largest_asks_first() -> None:
    assert share([("a", 30 * MIB), ("b", 40 * MIB), ("c", 0)], 50 * MIB) == {
        "b": 40 * MIB, "a": 10 * MIB}
    assert share([("a", 30 * MIB)], 30 * MIB) == {"a": 30 * MIB}
    assert share([("a", 30 * MIB)], PAGE_SIZE - 1) == {}


def test_online_levels_never_shared_cores_only_with_the_setting_and_the_annotation() -> None:
    opted = {CFG.annotation: "true"}
    both = dataclasses.replace(CFG, shared_cores=True)
    assert eligible("reclaimed_cores", {}, CFG)
    assert eligible("shared_cores", opted, both)
    assert not eligible("shared_cores", opted, CFG)  # the pod asks, the node does not allow
    assert not eligible("shared_cores", {}, both)  # the node allows, the pod does not ask
    assert not eligible("shared_cores", {CFG.annotation: "false"}, both)
    for level in ("dedicated_cores", "system_cores"):
        assert not eligible(level, opted, both)


def test_counters_from_memory_stat_and_memory_pressure() -> None:
    found = parse_counters(stat_text(scan=7, steal=5, ra=2, rf=3, ia=MIB),
                           PRESSURE.format(some=1234))
    assert found == Counters(1234, 7, 5, 5, INACTIVE, MIB)
    older = "pgscan 1\npgsteal 1\ninactive_file 0\ninactive_anon 0\nworkingset_refault 9\n"
    assert parse_counters(older, PRESSURE.format(some=0)).refault == 9
    with pytest.raises(ParseError, match="pgscan"):
        parse_counters("pgsteal 1\ninactive_file 0\ninactive_anon 0\n", PRESSURE.format(some=0))
    with pytest.raises(ParseError, match="some"):
        parse_counters(stat_text(), "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    with pytest.raises(ParseError, match="counter line"):  # a value that is not a number
        parse_counters(stat_text() + "pgscan many\n", PRESSURE.format(some=0))
