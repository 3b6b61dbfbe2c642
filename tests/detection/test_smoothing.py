"""Hysteresis: entry after N samples or a trigger, exit after the cooldown, flapping held."""

from __future__ import annotations

from reconciler.detection.detectors import Sample, unknown
from reconciler.detection.signals import NODE, Level
from reconciler.detection.smoothing import Smoother

N, COOLDOWN = 2, 10.0


def sample(level: Level, at: float, scope: str = NODE) -> Sample:
    return Sample("psi", scope, level, float(level), "percent", (10.0, 30.0, 50.0), at=at)


def feed(smoother: Smoother, levels: list[Level], *, step: float = 1.0, start: float = 0.0,
         triggered: bool = False) -> list[Level]:
    return [smoother.update(sample(level, start + i * step), entry_samples=N,
                            cooldown_s=COOLDOWN, triggered=triggered).level
            for i, level in enumerate(levels)]


def test_a_level_is_entered_after_n_consecutive_samples() -> None:
    s = Smoother()
    assert feed(s, [Level.LOW, Level.NONE, Level.LOW, Level.LOW]) == [
        Level.NONE, Level.NONE, Level.NONE, Level.LOW]


def test_higher_samples_count_for_the_lower_levels() -> None:
    s = Smoother()
    # MEDIUM then HIGH: two samples at or above MEDIUM enter MEDIUM; HIGH needs a second one
    assert feed(s, [Level.MEDIUM, Level.HIGH, Level.HIGH]) == [
        Level.NONE, Level.MEDIUM, Level.HIGH]


def test_a_trigger_enters_at_once() -> None:
    s = Smoother()
    assert feed(s, [Level.LOW], triggered=True) == [Level.LOW]
    assert feed(s, [Level.HIGH], start=1.0, triggered=True) == [Level.HIGH]


def test_a_level_is_left_only_after_the_cooldown() -> None:
    s = Smoother()
    feed(s, [Level.MEDIUM, Level.MEDIUM])  # t = 0, 1: MEDIUM
    # below from t = 2; still MEDIUM at t = 11.9, left at t = 12 (exactly the cooldown)
    levels = [s.update(sample(Level.NONE, t), entry_samples=N, cooldown_s=COOLDOWN).level
              for t in (2.0, 11.9, 12.0)]
    assert levels == [Level.MEDIUM, Level.MEDIUM, Level.NONE]


def test_exit_drops_to_the_raw_level_and_the_reading_carries_that_threshold() -> None:
    s = Smoother()
    feed(s, [Level.HIGH, Level.HIGH])
    held = s.update(sample(Level.LOW, 2.0), entry_samples=N, cooldown_s=COOLDOWN)
    assert (held.level, held.threshold) == (Level.HIGH, 50.0)
    left = s.update(sample(Level.LOW, 12.0), entry_samples=N, cooldown_s=COOLDOWN)
    assert (left.level, left.threshold) == (Level.LOW, 10.0)


def test_a_reading_says_whether_its_own_sample_is_at_the_level() -> None:
    s = Smoother()
    feed(s, [Level.MEDIUM])
    entered = s.update(sample(Level.MEDIUM, 1.0), entry_samples=N, cooldown_s=COOLDOWN)
    assert (entered.level, entered.raw, entered.fresh) == (Level.MEDIUM, Level.MEDIUM, True)
    higher = s.update(sample(Level.HIGH, 2.0), entry_samples=N, cooldown_s=COOLDOWN)
    assert (higher.level, higher.raw, higher.fresh) == (Level.MEDIUM, Level.HIGH, True)
    held = s.update(sample(Level.LOW, 3.0), entry_samples=N, cooldown_s=COOLDOWN)
    assert (held.level, held.raw, held.fresh) == (Level.MEDIUM, Level.LOW, False)


def test_a_flapping_signal_holds_its_level() -> None:
    s = Smoother()
    feed(s, [Level.LOW, Level.LOW])
    # LOW, NONE, LOW, NONE ... every second for a minute: the quiet spells never last 10 s
    flapping = [Level.NONE if i % 2 == 0 else Level.LOW for i in range(60)]
    assert set(feed(s, flapping, start=2.0)) == {Level.LOW}


def test_a_flapping_signal_never_enters_either() -> None:
    s = Smoother()
    assert set(feed(s, [Level.LOW, Level.NONE] * 20)) == {Level.NONE}


def test_a_return_above_resets_the_cooldown() -> None:
    s = Smoother()
    feed(s, [Level.LOW, Level.LOW])
    feed(s, [Level.NONE] * 9, start=2.0)  # below from 2 to 10
    feed(s, [Level.LOW], start=11.0)  # back: the quiet spell is over
    assert feed(s, [Level.NONE] * 10, start=12.0)[-1] is Level.LOW  # 12..21: not yet 10 s
    assert feed(s, [Level.NONE], start=22.0) == [Level.NONE]


def test_unknown_passes_at_once_and_forgets() -> None:
    s = Smoother()
    feed(s, [Level.HIGH, Level.HIGH])
    gone = s.update(unknown("psi", NODE, "empty pressure file", 2.0), entry_samples=N,
                    cooldown_s=COOLDOWN)
    assert (gone.level, gone.reason, gone.threshold) == (Level.UNKNOWN, "empty pressure file", 0)
    # after it, levels are entered from scratch
    assert feed(s, [Level.HIGH, Level.HIGH], start=3.0) == [Level.NONE, Level.HIGH]


def test_scopes_are_independent_and_can_be_forgotten() -> None:
    s = Smoother()
    for t in (0.0, 1.0):
        s.update(sample(Level.LOW, t, "pod:a"), entry_samples=N, cooldown_s=COOLDOWN)
    assert s.level(("psi", "pod:a")) is Level.LOW
    assert s.level(("psi", "pod:b")) is Level.NONE
    s.keep_only("psi", [])
    assert s.level(("psi", "pod:a")) is Level.NONE


def test_one_sample_enters_when_n_is_one_and_cooldown_zero_leaves_at_once() -> None:
    s = Smoother()
    assert s.update(sample(Level.MEDIUM, 0.0), entry_samples=1, cooldown_s=0).level is Level.MEDIUM
    assert s.update(sample(Level.NONE, 0.1), entry_samples=1, cooldown_s=0).level is Level.NONE
