"""The mitigation ladder: pure transitions on an injected clock, and the service with actions
that succeed, fail, hang, and run in dry-run."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
from collections.abc import Callable
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.detection.signals import NODE, Board, Level, Reading, pod_scope
from reconciler.mitigation.actions import DONE, DRY_RUN, FAILED, Cause, EvictAction, Result
from reconciler.mitigation.ladder import Backoff, Ladder, Rung, Step
from reconciler.mitigation.service import Mitigation, dry_run_of, rungs_of
from tests.support.polling import BOUND_S, eventually

TAINT, TUNE, DROP, EVICT = (Rung("taint", Level.LOW), Rung("tune", Level.LOW),
                            Rung("drop_cache", Level.MEDIUM, 30.0), Rung("evict", Level.HIGH, 5.0))
RUNGS = [TAINT, TUNE, DROP, EVICT]
COOLDOWN = 60.0


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


# -- the service ----------------------------------------------------------------------------------

class FakeAction:
    """Records calls; can fail or hang on a step."""

    def __init__(self, name: str, calls: list[tuple[str, str, bool]]) -> None:
        self.name = name
        self.calls = calls
        self.fail: BaseException | None = None
        # Steps answered "failed" (an API that refuses), not raised.
        self.refuse: set[str] = set()
        self.hang = asyncio.Event()
        self.hanging = False

    async def _run(self, step: str, cause: Cause, dry_run: bool) -> Result:
        self.calls.append((self.name, step, dry_run))
        if self.hanging:
            await self.hang.wait()
        if self.fail is not None:
            raise self.fail
        if step in self.refuse:
            return Result(FAILED, f"{self.name} {step} refused")
        return Result(DRY_RUN if dry_run else DONE, f"{self.name} {step}")

    async def engage(self, cause: Cause, dry_run: bool) -> Result:
        return await self._run("engage", cause, dry_run)

    async def repeat(self, cause: Cause, dry_run: bool) -> Result:
        return await self._run("repeat", cause, dry_run)

    async def release(self, cause: Cause, dry_run: bool) -> Result:
        return await self._run("release", cause, dry_run)


def config(cooldown: float = 0.2, **rungs: dict[str, Any]) -> Config:
    cfg = Config()
    m = cfg.mitigation
    changes = {name: dataclasses.replace(getattr(m, name), **values)
               for name, values in rungs.items()}
    return dataclasses.replace(cfg, mitigation=dataclasses.replace(m, cooldown_s=cooldown,
                                                                   **changes))


def reading(detector: str, level: Level, scope: str = NODE, value: float = 42.0) -> Reading:
    return Reading(detector, scope, level, value, 10.0, "percent", "test reading")


class Running:
    def __init__(self, cfg: Config, names: tuple[str, ...] = ("taint", "tune", "drop_cache",
                                                               "evict")) -> None:
        self.cfg = cfg
        self.board = Board()
        self.sink = MemoryAuditSink()
        self.calls: list[tuple[str, str, bool]] = []
        self.actions = {name: FakeAction(name, self.calls) for name in names}
        self.mitigation = Mitigation(lambda: self.cfg, self.board, self.actions,
                                     AuditLog(self.sink))
        self.stop = asyncio.Event()

    async def __aenter__(self) -> Running:
        self.task = asyncio.create_task(self.mitigation.run(self.stop))
        # the start clears what an earlier run may have left: one release per rung
        await self.until(lambda: len(self.calls) >= len(self.actions))
        assert sorted(self.calls) == sorted((n, "release", dry_run_of(self.cfg.mitigation, n))
                                            for n in self.actions)
        self.calls.clear()
        self.sink.records.clear()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, BOUND_S)

    async def until(self, check: Callable[[], bool]) -> None:
        await eventually(check)

    def actions_audited(self) -> list[tuple[str, str, str, bool]]:
        return [(r["action"], r["step"], r["result"], r["dry_run"])
                for r in self.sink.named("mitigation_action")]


async def test_the_service_escalates_and_releases_with_audit() -> None:
    async with Running(config()) as run:
        run.board.publish("psi", [reading("psi", Level.LOW)])
        assert not run.mitigation.engaged()
        await run.until(lambda: len(run.calls) == 2)
        assert run.calls == [("taint", "engage", False), ("tune", "engage", False)]
        assert run.mitigation.engaged()  # what holds offloading off
        [level] = run.sink.named("mitigation_level")
        assert (level["ladder_level"], level["previous"]) == ("low", "none")
        record = run.sink.named("mitigation_action")[0]
        assert (record["detector"], record["scope"], record["value"], record["threshold"]) == (
            "psi", NODE, 42.0, 10.0)
        assert "psi on node at 42 percent, threshold 10" in record["reason"]
        run.board.publish("psi", [reading("psi", Level.NONE)])
        await run.until(lambda: len(run.calls) == 4)  # released after the 0.2 s cooldown
        assert run.calls[2:] == [("tune", "release", False), ("taint", "release", False)]
        await run.until(lambda: not run.mitigation.engaged())


async def test_dry_run_is_per_rung() -> None:
    cfg = config(taint={"dry_run": True})
    async with Running(cfg) as run:
        run.board.publish("system_free", [reading("system_free", Level.HIGH)])
        await run.until(lambda: len(run.calls) == 4)
        assert run.calls == [("taint", "engage", True), ("tune", "engage", False),
                             ("drop_cache", "engage", False), ("evict", "engage", True)]
        assert [(a, res, dry) for a, _, res, dry in run.actions_audited()] == [
            ("taint", DRY_RUN, True), ("tune", DONE, False), ("drop_cache", DONE, False),
            ("evict", DRY_RUN, True)]


async def test_a_failing_action_is_audited_and_stops_nothing() -> None:
    async with Running(config()) as run:
        run.actions["taint"].fail = OSError(errno.EBUSY, "Device or resource busy")
        run.board.publish("psi", [reading("psi", Level.MEDIUM)])
        await run.until(lambda: len(run.sink.named("mitigation_action")) == 3)
        results = {a: (res, r["detail"]) for (a, _, res, _), r in
                   zip(run.actions_audited(), run.sink.named("mitigation_action"), strict=True)}
        assert results["taint"] == ("failed", "OSError: [Errno 16] Device or resource busy")
        assert results["tune"][0] == results["drop_cache"][0] == DONE


async def test_a_hanging_action_stalls_neither_the_ladder_nor_the_other_rungs() -> None:
    async with Running(config(drop_cache={"repeat_s": 1.0})) as run:
        run.actions["taint"].hanging = True
        run.board.publish("psi", [reading("psi", Level.MEDIUM)])
        await run.until(lambda: ("drop_cache", "repeat", False) in run.calls)
        assert [c for c in run.calls if c[0] == "taint"] == [("taint", "engage", False)]
        # the ladder still de-escalates the other rungs while taint hangs
        run.board.publish("psi", [reading("psi", Level.NONE)])
        await run.until(lambda: ("tune", "release", False) in run.calls)
        assert ("drop_cache", "release", False) in run.calls
        # taint's release waits behind its hung engage; stop cancels both
        assert ("taint", "release", False) not in run.calls
    assert run.task.done()
    assert not run.task.cancelled()


async def test_a_hanging_action_finishes_then_its_latest_step_runs() -> None:
    async with Running(config()) as run:
        run.actions["taint"].hanging = True
        run.board.publish("psi", [reading("psi", Level.LOW)])
        await run.until(lambda: ("tune", "engage", False) in run.calls)
        run.board.publish("psi", [reading("psi", Level.NONE)])
        await run.until(lambda: ("tune", "release", False) in run.calls)
        run.actions["taint"].hanging = False
        run.actions["taint"].hang.set()
        await run.until(lambda: ("taint", "release", False) in run.calls)
        assert [c[1] for c in run.calls if c[0] == "taint"] == ["engage", "release"]


async def test_unknown_holds_the_last_known_level() -> None:
    async with Running(config()) as run:
        run.board.publish("psi", [reading("psi", Level.LOW)])
        await run.until(lambda: len(run.calls) == 2)
        run.board.publish("psi", [reading("psi", Level.UNKNOWN)])
        await asyncio.sleep(0.5)  # well past the 0.2 s cooldown
        assert len(run.calls) == 2  # nothing released: unknown is not "no pressure"
        assert run.mitigation.state().level is Level.LOW
        run.board.publish("psi", [])  # the detector went away: nothing holds the level
        await run.until(lambda: len(run.calls) == 4)


async def test_a_detector_unknown_from_the_start_does_not_block_releases() -> None:
    async with Running(config()) as run:
        run.board.publish("kswapd", [reading("kswapd", Level.UNKNOWN)])
        run.board.publish("psi", [reading("psi", Level.LOW)])
        await run.until(lambda: len(run.calls) == 2)
        run.board.publish("psi", [reading("psi", Level.NONE)])
        await run.until(lambda: len(run.calls) == 4)


async def test_the_cause_is_fresh_pressure_rather_than_a_level_held() -> None:
    async with Running(config()) as run:
        held = dataclasses.replace(reading("psi", Level.LOW), raw=Level.NONE)
        fresh = dataclasses.replace(reading("pressure_level", Level.LOW, "tier:kubepods"),
                                    raw=Level.LOW)
        run.board.publish("psi", [held])
        assert run.mitigation.assess().reading == held
        run.board.publish("pressure_level", [fresh])
        assert run.mitigation.assess().reading == fresh
        # a worse level wins even when only held
        worse = dataclasses.replace(reading("psi", Level.MEDIUM), raw=Level.NONE)
        run.board.publish("psi", [worse])
        assert run.mitigation.assess().reading == worse
        # an unknown reading standing for its last known level is never fresh
        run.board.publish("psi", [reading("psi", Level.UNKNOWN)])
        cause = run.mitigation.assess()
        assert cause.level is Level.MEDIUM
        run.board.publish("pressure_level", [dataclasses.replace(fresh, level=Level.MEDIUM,
                                                                 raw=Level.MEDIUM)])
        found = run.mitigation.assess().reading
        assert found is not None
        assert found.detector == "pressure_level"


def assessed(cfg: Config, memcg_events: bool, *readings: Reading) -> Level:
    board = Board()
    for r in readings:
        board.publish(r.detector, [r])
    return Mitigation(lambda: cfg, board, {}, AuditLog(MemoryAuditSink()),
                      memcg_events=memcg_events).assess().level


def with_node_psi(choice: str, **detection: Any) -> Config:
    cfg = config()
    return dataclasses.replace(
        cfg, mitigation=dataclasses.replace(cfg.mitigation, node_psi=choice),
        detection=dataclasses.replace(cfg.detection, **detection))


@pytest.mark.parametrize(("choice", "memcg_events", "drives"), [
    ("auto", True, False), ("auto", False, True), ("on", True, True), ("on", False, True),
    ("off", True, False), ("off", False, False)])
def test_node_psi_drives_the_ladder_where_memcg_events_do_not(
        choice: str, memcg_events: bool, drives: bool) -> None:
    node = reading("psi", Level.MEDIUM)
    assert assessed(with_node_psi(choice), memcg_events, node) is (
        Level.MEDIUM if drives else Level.NONE)
    # an online pod's own PSI always counts
    pod = reading("psi", Level.LOW, pod_scope("web"))
    assert assessed(with_node_psi(choice), memcg_events, pod) is Level.LOW


def test_node_psi_drives_when_the_memcg_events_are_switched_off() -> None:
    node = reading("psi", Level.LOW)
    assert assessed(with_node_psi("auto", disabled=("pressure_level",)), True,
                    node) is Level.LOW
    assert assessed(with_node_psi("auto", enabled=False), True, node) is Level.LOW
    cfg = with_node_psi("auto")
    cfg = dataclasses.replace(cfg, mitigation=dataclasses.replace(
        cfg.mitigation, detectors=("psi", "system_free")))
    assert assessed(cfg, True, node) is Level.LOW


async def test_only_the_configured_detectors_drive_the_ladder() -> None:
    async with Running(config()) as run:
        run.board.publish("rss_overuse", [reading("rss_overuse", Level.HIGH, pod_scope("u"))])
        run.board.publish("fulfillment", [reading("fulfillment", Level.HIGH, "tier:x")])
        await asyncio.sleep(0.2)
        assert run.calls == []
        assert run.mitigation.state().level is Level.NONE


async def test_state_reports_level_engaged_rungs_and_last_results() -> None:
    async with Running(config(cooldown=60.0)) as run:
        run.board.publish("psi", [reading("psi", Level.LOW)])
        await run.until(lambda: len(run.calls) == 2)
        await run.until(lambda: len(run.mitigation.state().last) == 4)
        state = run.mitigation.state()
        assert state.level is Level.LOW
        assert state.engaged == ("taint", "tune")
        assert state.last["taint"] == ("engage", DONE, "taint engage")
        assert "psi on node" in state.cause


async def test_evict_rung_without_an_evictor() -> None:
    action = EvictAction(None)
    cause = Cause(Level.HIGH)
    assert await action.engage(cause, False) == Result("skipped", "no evictor")
    assert (await action.engage(cause, True)).result == DRY_RUN

    class Manager:
        def __init__(self) -> None:
            self.reasons: list[str] = []

        def request_round(self, reason: str) -> None:
            self.reasons.append(reason)

    manager = Manager()
    assert (await EvictAction(manager).repeat(cause, False)).result == DONE
    assert manager.reasons == [cause.text()]
    assert (await EvictAction(manager).release(cause, False)).result == "unchanged"


@pytest.mark.parametrize("level", [Level.LOW, Level.HIGH])
def test_cause_text_names_the_reading(level: Level) -> None:
    assert Cause(level).text() == f"level {level.name.lower()}: no detector reports pressure"
    text = Cause(level, reading("psi", level)).text()
    assert text.startswith(f"level {level.name.lower()}: psi on node at 42 percent, threshold 10")


def test_cause_text_shows_bytes_whole() -> None:
    free = Reading("system_free", NODE, Level.LOW, 23446401024.0, 2147483648.0, "bytes", "r")
    assert "system_free on node at 21.8 GiB, threshold 2.0 GiB (r)" in Cause(Level.LOW, free).text()


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
