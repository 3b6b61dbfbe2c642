"""The mitigation ladder's pure transitions on an injected clock: escalation, de-escalation after
the cooldown, hysteresis, repeats, and rungs from the configuration."""

from __future__ import annotations

import dataclasses

from nri_plugin.config.schema import Config
from reconciler.detection.signals import Level
from reconciler.mitigation.ladder import Ladder, Step
from reconciler.mitigation.service import rungs_of
from tests.support.ladder import COOLDOWN, RUNGS, TUNE

# -- the ladder, pure -----------------------------------------------------------------------------

def test_escalation_engages_least_harmful_first() -> None:
    ladder = Ladder()
    assert ladder.step(Level.NONE, 0.0, RUNGS, COOLDOWN) == []
    assert ladder.step(Level.LOW, 1.0, RUNGS, COOLDOWN) == [("taint", Step.ENGAGE),
                                                            ("tune", Step.ENGAGE)]
    assert ladder.step(Level.MEDIUM, 2.0, RUNGS, COOLDOWN) == [("drop_cache", Step.ENGAGE)]
    assert ladder.step(Level.HIGH, 3.0, RUNGS, COOLDOWN) == [("evict", Step.ENGAGE)]
    assert ladder.step(Level.HIGH, 4.0, RUNGS, COOLDOWN) == []  # nothing new, no repeat due


def test_a_jump_engages_every_rung_in_order() -> None:
    assert Ladder().step(Level.HIGH, 0.0, RUNGS, COOLDOWN) == [
        (r.name, Step.ENGAGE) for r in RUNGS]


def test_de_escalation_waits_for_the_cooldown_and_releases_most_harmful_first() -> None:
    ladder = Ladder()
    ladder.step(Level.HIGH, 0.0, RUNGS, COOLDOWN)
    assert ladder.step(Level.NONE, 10.0, RUNGS, COOLDOWN) == []
    assert ladder.step(Level.NONE, 69.9, RUNGS, COOLDOWN) == []
    assert ladder.step(Level.NONE, 70.0, RUNGS, COOLDOWN) == [
        ("evict", Step.RELEASE), ("drop_cache", Step.RELEASE), ("tune", Step.RELEASE),
        ("taint", Step.RELEASE)]
    assert ladder.engaged == ()


def test_partial_de_escalation_keeps_the_lower_rungs() -> None:
    ladder = Ladder()
    ladder.step(Level.HIGH, 0.0, RUNGS, COOLDOWN)
    ladder.step(Level.LOW, 1.0, RUNGS, COOLDOWN)
    assert ladder.step(Level.LOW, 61.0, RUNGS, COOLDOWN) == [
        ("evict", Step.RELEASE), ("drop_cache", Step.RELEASE)]
    assert ladder.engaged == ("taint", "tune")


def test_hysteresis_a_return_within_the_cooldown_keeps_the_rung() -> None:
    ladder = Ladder()
    ladder.step(Level.LOW, 0.0, RUNGS, COOLDOWN)
    ladder.step(Level.NONE, 1.0, RUNGS, COOLDOWN)
    assert ladder.step(Level.LOW, 50.0, RUNGS, COOLDOWN) == []  # back: no second engage
    assert ladder.step(Level.NONE, 51.0, RUNGS, COOLDOWN) == []
    assert ladder.step(Level.NONE, 110.9, RUNGS, COOLDOWN) == []  # 60 s from 51, not from 1
    assert [s for _, s in ladder.step(Level.NONE, 111.0, RUNGS, COOLDOWN)] == [Step.RELEASE] * 2


def test_flapping_input_engages_once_and_releases_once() -> None:
    ladder = Ladder()
    steps: list[tuple[str, Step]] = []
    for t in range(120):
        steps += ladder.step(Level.LOW if t % 2 else Level.NONE, float(t), RUNGS, COOLDOWN)
    assert steps == [("taint", Step.ENGAGE), ("tune", Step.ENGAGE)]
    # the last LOW was at t = 119: released 60 s after the level fell (t = 120), at 180
    assert ladder.step(Level.NONE, 120.0, RUNGS, COOLDOWN) == []
    assert ladder.step(Level.NONE, 179.9, RUNGS, COOLDOWN) == []
    assert len(ladder.step(Level.NONE, 180.0, RUNGS, COOLDOWN)) == 2


def test_repeats_while_the_level_holds_and_not_while_below() -> None:
    ladder = Ladder()
    ladder.step(Level.MEDIUM, 0.0, RUNGS, COOLDOWN)
    assert ladder.step(Level.MEDIUM, 29.9, RUNGS, COOLDOWN) == []
    assert ladder.step(Level.MEDIUM, 30.0, RUNGS, COOLDOWN) == [("drop_cache", Step.REPEAT)]
    assert ladder.step(Level.LOW, 60.0, RUNGS, COOLDOWN) == []  # below: no repeat
    assert ladder.next_due(RUNGS, COOLDOWN) == 120.0  # drop_cache's release
    assert ladder.step(Level.MEDIUM, 61.0, RUNGS, COOLDOWN) == [("drop_cache", Step.REPEAT)]
    assert ladder.next_due(RUNGS, COOLDOWN) == 91.0


def test_a_rung_switched_off_is_released_at_once() -> None:
    ladder = Ladder()
    ladder.step(Level.LOW, 0.0, RUNGS, COOLDOWN)
    assert ladder.step(Level.LOW, 1.0, [TUNE], COOLDOWN) == [("taint", Step.RELEASE)]
    assert ladder.next_due([TUNE], COOLDOWN) is None


def test_rungs_come_from_the_configuration() -> None:
    cfg = Config()
    assert [(r.name, r.level, r.repeat_s) for r in rungs_of(cfg)] == [
        ("taint", Level.LOW, None), ("tune", Level.LOW, 5.0),
        ("drop_cache", Level.MEDIUM, 30.0), ("evict", Level.HIGH, 5.0)]
    off = dataclasses.replace(cfg, mitigation=dataclasses.replace(
        cfg.mitigation, tune=dataclasses.replace(cfg.mitigation.tune, enabled=False),
        evict=dataclasses.replace(cfg.mitigation.evict, level="medium")))
    assert [(r.name, r.level) for r in rungs_of(off)] == [
        ("taint", Level.LOW), ("drop_cache", Level.MEDIUM), ("evict", Level.MEDIUM)]
    assert rungs_of(dataclasses.replace(cfg, mitigation=dataclasses.replace(
        cfg.mitigation, enabled=False))) == []
    assert rungs_of(dataclasses.replace(cfg, reconciler=dataclasses.replace(
        cfg.reconciler, enabled=False))) == []
