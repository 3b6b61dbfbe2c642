"""The eviction manager's pacing: the token bucket at its exact boundaries, and the smoothing of
thresholds and conditions on an injected clock."""

from __future__ import annotations

import pytest

from reconciler.eviction.api import MetType
from reconciler.eviction.ratelimit import TokenBucket
from reconciler.eviction.smoothing import ConditionTracker, MetSmoother

# ---- the token bucket ---------------------------------------------------------------------------


def test_bucket_burst_then_one_per_interval_at_exact_boundaries() -> None:
    bucket = TokenBucket(3, 10.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.wait(0.0) == 10.0
    assert not bucket.take(9.999)
    assert bucket.wait(9.5) == 0.5
    assert bucket.take(10.0)
    assert not bucket.take(10.0)
    assert not bucket.take(19.999)
    assert bucket.take(20.0)
    # Idle for long: never more than the burst.
    assert bucket.available(1000.0) == 3
    assert [bucket.take(1000.0) for _ in range(4)] == [True, True, True, False]


def test_bucket_refill_counts_from_the_first_token_taken() -> None:
    bucket = TokenBucket(2, 10.0, now=0.0)
    assert bucket.take(5.0)  # full until now: the refill interval starts here
    assert bucket.take(6.0)
    assert not bucket.take(14.999)
    assert bucket.take(15.0)  # 10 s after the first token left
    assert bucket.available(24.999) == 0
    assert bucket.available(25.0) == 1
    assert bucket.available(35.0) == 2


def test_bucket_give_back_and_reconfigure() -> None:
    bucket = TokenBucket(3, 10.0, now=0.0)
    assert bucket.take(0.0)
    bucket.give_back(0.0)
    assert bucket.available(0.0) == 3
    bucket.give_back(0.0)
    assert bucket.available(0.0) == 3  # never above the burst
    bucket.configure(1, 10.0, 0.0)
    assert [bucket.take(0.0) for _ in range(2)] == [True, False]
    bucket.configure(1, 2.0, 0.0)
    assert bucket.take(2.0)
    with pytest.raises(ValueError, match="burst"):
        TokenBucket(0, 1.0, 0.0)


def test_bucket_wait_is_zero_while_a_token_is_there() -> None:
    bucket = TokenBucket(2, 10.0, now=0.0)
    assert bucket.wait(0.0) == 0.0
    assert bucket.take(0.0)
    assert bucket.wait(0.0) == 0.0  # one left
    assert bucket.take(0.0)
    assert bucket.wait(0.0) == 10.0
    assert bucket.wait(10.0) == 0.0


def test_bucket_give_back_from_two_below_the_burst_keeps_the_refill() -> None:
    bucket = TokenBucket(3, 10.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [True, True, True]
    bucket.give_back(1.0)
    assert bucket.available(1.0) == 1
    # The refill under way since 0 still ends at 10, not 11.
    assert bucket.available(9.999) == 1
    assert bucket.available(10.0) == 2
    bucket.give_back(10.0)
    assert bucket.available(10.0) == 3
    bucket.give_back(10.0)
    assert bucket.available(10.0) == 3


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan")])
def test_bucket_refuses_an_interval_that_is_not_positive(interval: float) -> None:
    with pytest.raises(ValueError, match="interval > 0"):
        TokenBucket(1, interval, 0.0)
    bucket = TokenBucket(2, 10.0, 0.0)
    assert bucket.take(0.0)
    with pytest.raises(ValueError, match="interval > 0"):
        bucket.configure(2, interval, 1.0)
    # Unchanged, and refilling as before.
    assert bucket.available(9.999) == 1
    assert bucket.available(10.0) == 2
    with pytest.raises(ValueError, match="burst >= 1"):
        bucket.configure(0, 10.0, 1.0)


def test_bucket_reload_in_the_middle_of_a_refill_counts_the_time_waited() -> None:
    bucket = TokenBucket(2, 10.0, now=0.0)
    assert bucket.take(0.0)
    assert bucket.take(0.0)
    bucket.configure(2, 20.0, 5.0)  # 5 s into a 10 s refill; the interval is now 20 s
    assert bucket.available(19.999) == 0
    assert bucket.available(20.0) == 1
    assert bucket.wait(20.0) == 0.0
    assert bucket.take(20.0)
    assert bucket.wait(20.0) == 20.0
    # A shorter interval: a token the old one had not given yet comes at once.
    bucket.configure(2, 5.0, 26.0)
    assert bucket.available(26.0) == 1


def test_bucket_clock_going_backwards_mints_nothing() -> None:
    bucket = TokenBucket(2, 10.0, now=100.0)
    assert bucket.take(100.0)
    assert bucket.take(100.0)
    assert bucket.available(50.0) == 0
    assert bucket.wait(50.0) == 10.0  # never more than one interval
    assert bucket.available(59.999) == 0
    assert bucket.available(60.0) == 1
    # Back again: the token it has, no more.
    assert bucket.take(40.0)
    assert not bucket.take(40.0)
    assert bucket.available(49.999) == 0
    assert bucket.available(50.0) == 1


# ---- smoothing ----------------------------------------------------------------------------------


def test_a_condition_met_at_its_first_observation_stays_true_for_the_transition() -> None:
    tracker = ConditionTracker()
    assert tracker.observe("C", True, 0.0, 300.0) is True
    assert tracker.observe("C", False, 1.0, 300.0) is True
    assert tracker.observe("C", False, 299.999, 300.0) is True
    assert tracker.observe("C", False, 300.0, 300.0) is False
    assert tracker.status("C") is False
    # Never met: false from the first observation.
    assert tracker.observe("D", False, 0.0, 300.0) is False


def test_hard_met_counts_after_a_streak() -> None:
    met = MetSmoother()
    hard = MetType.HARD_MET
    assert met.observe("p", hard, 3) is MetType.SOFT_MET
    assert met.observe("p", hard, 3) is MetType.SOFT_MET
    assert met.observe("p", hard, 3) is hard
    assert met.observe("p", hard, 3) is hard
    assert met.observe("p", MetType.SOFT_MET, 3) is MetType.SOFT_MET  # breaks the streak
    assert met.observe("p", hard, 3) is MetType.SOFT_MET
    assert met.observe("p", hard, 3) is MetType.SOFT_MET
    assert met.observe("p", None, 3) is MetType.NOT_MET  # no answer breaks it too
    assert met.observe("p", hard, 1) is hard
    assert met.observe("other", hard, 2) is MetType.SOFT_MET  # per plugin
    met.keep_only(["p"])
    assert met.observe("other", hard, 2) is MetType.SOFT_MET
    assert met.observe("p", hard, 2) is hard  # a kept plugin's streak goes on


def test_condition_true_at_once_false_after_the_transition_period() -> None:
    tracker = ConditionTracker()
    assert tracker.observe("C", False, 0.0, 300.0) is False
    assert tracker.observe("C", True, 10.0, 300.0) is True
    assert tracker.observe("C", False, 11.0, 300.0) is True
    assert tracker.observe("C", False, 309.999, 300.0) is True
    assert tracker.observe("C", False, 310.0, 300.0) is False
    # Flapping keeps it true: every "met" restarts the period.
    for t in range(400, 1000, 100):
        assert tracker.observe("C", True, float(t), 300.0) is True
        assert tracker.observe("C", False, t + 50.0, 300.0) is True
    assert tracker.observe("C", False, 900.0 + 300.0, 300.0) is False
    assert tracker.status("C") is False
    assert tracker.status("unknown") is None
    assert tracker.names() == ["C"]
