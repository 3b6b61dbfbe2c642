"""Retries on the mitigation ladder: failed releases and engages retried with backoff, rungs
removed from the configuration, and leftovers released whatever the config."""

from __future__ import annotations

import asyncio
import dataclasses

from reconciler.detection.signals import Level
from reconciler.mitigation.ladder import Backoff, Ladder, Step
from tests.support.ladder import COOLDOWN, RUNGS, TAINT, TUNE, Running, config, reading

# -- outcomes fed back: retries -------------------------------------------------------------------

BACKOFF = Backoff(1.0, 4.0)


def released_at(ladder: Ladder, at: float) -> None:
    """Engages the taint rung at 0 and has it released at ``at`` (after the cooldown)."""
    assert ladder.step(Level.LOW, 0.0, [TAINT], COOLDOWN) == [("taint", Step.ENGAGE)]
    ladder.finished("taint", Step.ENGAGE, True, 0.0, BACKOFF)
    ladder.step(Level.NONE, 1.0, [TAINT], COOLDOWN)
    assert ladder.step(Level.NONE, at, [TAINT], COOLDOWN) == [("taint", Step.RELEASE)]


def test_a_failed_release_is_retried_with_backoff_until_it_succeeds() -> None:
    ladder = Ladder()
    released_at(ladder, 61.0)
    assert ladder.releasing == ("taint",)
    # In flight: nothing more is asked, nothing is due.
    assert ladder.step(Level.NONE, 62.0, [TAINT], COOLDOWN) == []
    assert ladder.next_due([TAINT], COOLDOWN) is None
    ladder.finished("taint", Step.RELEASE, False, 61.5, BACKOFF)
    assert ladder.next_due([TAINT], COOLDOWN) == 62.5
    assert ladder.step(Level.NONE, 62.49, [TAINT], COOLDOWN) == []
    assert ladder.step(Level.NONE, 62.5, [TAINT], COOLDOWN) == [("taint", Step.RELEASE)]
    # The wait doubles, up to its cap.
    waits = []
    now = 62.5
    for _ in range(4):
        ladder.finished("taint", Step.RELEASE, False, now, BACKOFF)
        due = ladder.next_due([TAINT], COOLDOWN)
        assert due is not None
        waits.append(due - now)
        now = due
        assert ladder.step(Level.NONE, now, [TAINT], COOLDOWN) == [("taint", Step.RELEASE)]
    assert waits == [2.0, 4.0, 4.0, 4.0]
    ladder.finished("taint", Step.RELEASE, True, now, BACKOFF)
    assert not ladder.releasing
    assert ladder.next_due([TAINT], COOLDOWN) is None
    assert ladder.step(Level.NONE, now + 100, [TAINT], COOLDOWN) == []


def test_a_failed_engage_is_retried_while_the_level_holds() -> None:
    ladder = Ladder()
    assert ladder.step(Level.LOW, 0.0, [TAINT], COOLDOWN) == [("taint", Step.ENGAGE)]
    ladder.finished("taint", Step.ENGAGE, False, 0.5, BACKOFF)
    assert ladder.next_due([TAINT], COOLDOWN) == 1.5
    assert ladder.step(Level.LOW, 1.49, [TAINT], COOLDOWN) == []
    assert ladder.step(Level.LOW, 1.5, [TAINT], COOLDOWN) == [("taint", Step.ENGAGE)]
    ladder.finished("taint", Step.ENGAGE, True, 1.6, BACKOFF)
    assert ladder.next_due([TAINT], COOLDOWN) is None
    assert ladder.step(Level.LOW, 50.0, [TAINT], COOLDOWN) == []


def test_a_rung_being_released_is_engaged_anew_when_the_level_comes_back() -> None:
    ladder = Ladder()
    released_at(ladder, 61.0)
    ladder.finished("taint", Step.RELEASE, False, 61.0, BACKOFF)
    assert ladder.step(Level.LOW, 61.5, [TAINT], COOLDOWN) == [("taint", Step.ENGAGE)]
    assert ladder.engaged == ("taint",)
    assert not ladder.releasing


def test_a_rung_removed_from_the_config_is_released_once_then_forgotten() -> None:
    ladder = Ladder()
    ladder.step(Level.LOW, 0.0, RUNGS, COOLDOWN)
    assert ladder.step(Level.LOW, 1.0, [TUNE], COOLDOWN) == [("taint", Step.RELEASE)]
    ladder.finished("taint", Step.RELEASE, True, 1.0, BACKOFF)
    for now in (2.0, 100.0, 1000.0):
        assert ladder.step(Level.LOW, now, [TUNE], COOLDOWN) == []
        assert ladder.step(Level.NONE, now + 1, [TUNE], COOLDOWN) in ([], [("tune", Step.RELEASE)])
    assert "taint" not in ladder.releasing


def test_a_removed_rung_whose_release_failed_is_still_retried() -> None:
    ladder = Ladder()
    ladder.step(Level.LOW, 0.0, [TAINT], COOLDOWN)
    assert ladder.step(Level.LOW, 1.0, [], COOLDOWN) == [("taint", Step.RELEASE)]
    ladder.finished("taint", Step.RELEASE, False, 1.0, BACKOFF)
    assert ladder.next_due([], COOLDOWN) == 2.0
    assert ladder.step(Level.LOW, 2.0, [], COOLDOWN) == [("taint", Step.RELEASE)]


def test_leftovers_are_released_and_retried_whatever_the_config() -> None:
    ladder = Ladder()
    assert ladder.release_leftovers(["taint", "tune"]) == [("taint", Step.RELEASE),
                                                            ("tune", Step.RELEASE)]
    ladder.finished("tune", Step.RELEASE, True, 0.0, BACKOFF)
    ladder.finished("taint", Step.RELEASE, False, 0.0, BACKOFF)
    # The taint rung is switched off in the configuration: its leftover still goes.
    assert ladder.step(Level.NONE, 1.0, [TUNE], COOLDOWN) == [("taint", Step.RELEASE)]


async def test_the_service_retries_a_failed_release() -> None:
    cfg = dataclasses.replace(config(cooldown=0.05), mitigation=dataclasses.replace(
        config(cooldown=0.05).mitigation, retry_initial_s=0.1, retry_max_s=0.1))
    async with Running(cfg, names=("taint",)) as run:
        run.board.publish("psi", [reading("psi", Level.LOW)])
        await run.until(lambda: ("taint", "engage", False) in run.calls)
        run.actions["taint"].refuse.add("release")
        run.board.publish("psi", [reading("psi", Level.NONE)])
        await run.until(lambda: run.calls.count(("taint", "release", False)) >= 3)
        # What status shows meanwhile: nothing engaged, the taint rung still being released.
        state = run.mitigation.state()
        assert (state.engaged, state.releasing) == ((), ("taint",))
        assert run.mitigation.engaged()  # a release not confirmed: the ladder still owns it
        run.actions["taint"].refuse.discard("release")
        await run.until(lambda: any(a == ("taint", "release", "done", False)
                                    for a in run.actions_audited()))
        settled = len(run.calls)
        await asyncio.sleep(0.4)
        assert len(run.calls) == settled
        assert run.mitigation.state().engaged == ()
        assert run.mitigation.state().releasing == ()
        assert not run.mitigation.engaged()
