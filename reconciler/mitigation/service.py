"""Running the ladder: readings in, actions out, every step audited.

The service wakes when a level on the readings board changes (the board calls it from the
publishing thread; the wake-up is handed to the event loop) and when a repeat or a release falls
due. The ladder's level is the worst level of the detectors named in ``mitigation.detectors``.
A reading that turned ``unknown`` counts at the level it last had: an unreadable file is never
taken for the end of pressure (a detector unknown from the start counts as none: it never
reported pressure).

Each rung's action runs in a task of its own, one step at a time per rung (a step that comes
while the previous one runs waits, and only the latest waits: actions are idempotent), so an
action that hangs or fails stalls neither the ladder nor the other rungs. Every step is audited
as ``mitigation_action`` with the cause (detector, scope, value, threshold), the result and
whether it was a dry run; a change of the ladder's level as ``mitigation_level``. The result goes
back to the ladder too: a step that failed or timed out is tried again (see
:mod:`reconciler.mitigation.ladder`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import structlog

from common.aio import sleep_until, waker
from common.audit import AuditLog
from common.state import NodeState
from reconciler.detection.config import PRESSURE_LEVEL, PSI, REFAULT, DetectionConfig
from reconciler.detection.counting import Counting
from reconciler.detection.notified import pressure_level_problem
from reconciler.detection.pods import PodIndex
from reconciler.detection.signals import LEVEL_BY_NAME, Board, Level, Reading
from reconciler.host.probe import HostInfo
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.kube import KubeActions
from reconciler.loops.base import ReconcilerConfig
from reconciler.loops.common import ManagedCache
from reconciler.loops.memory_guard import MemoryGuardConfig
from reconciler.loops.memory_squeeze import GuardSqueeze
from reconciler.metrics import ReconcilerMetrics
from reconciler.mitigation.actions import (
    FAILED,
    TIMEOUT,
    Action,
    Cause,
    EvictAction,
    Evictor,
    PlacedTaint,
    Result,
    TaintAction,
    TuneAction,
)
from reconciler.mitigation.config import MitigationConfig
from reconciler.mitigation.drop_cache import DropCacheAction
from reconciler.mitigation.ladder import Backoff, Ladder, Rung, Step

log = structlog.get_logger("nri_qos.mitigation")

RUNGS = ("taint", "tune", "drop_cache", "evict")
"""The rungs, least harmful first."""

UNCONFIRMED = frozenset({FAILED, TIMEOUT})
"""Results that leave a step's effect unknown: the ladder tries the step again."""

IDLE_RECHECK_S = 5.0
"""With nothing due, the service still looks again this often (a configuration reload may have
switched a rung off that must be released)."""


class LadderSections(Protocol):
    @property
    def reconciler(self) -> ReconcilerConfig: ...

    @property
    def detection(self) -> DetectionConfig: ...

    @property
    def mitigation(self) -> MitigationConfig: ...

    @property
    def memory_guard(self) -> MemoryGuardConfig: ...


def counting(cfg: LadderSections, memcg_events: bool, pod_psi: bool,
             pod_refaults: bool) -> Counting:
    """Which kinds of reading count for the ladder (``mitigation.node_signals``; the kinds:
    :mod:`reconciler.detection.counting`). ``memcg_events``: the host has memcg pressure
    notifications (cgroup v1); ``pod_psi``: each online pod's PSI is read (cgroup v2);
    ``pod_refaults``: each online pod's refaults are read (cgroup v1). ``on``: every kind.
    ``auto``: each coarser kind only where no finer one drives the ladder (absent, or switched
    off for detection or for the ladder). ``off``: never the node-wide readings, the memcg
    events as with ``auto``."""
    choice = cfg.mitigation.node_signals
    if choice == "on":
        return Counting(memcg=True, node=True)
    detection = cfg.detection

    def driving(detector: str, present: bool) -> bool:
        return (present and detection.enabled and detector not in detection.disabled
                and detector in cfg.mitigation.detectors)

    own = driving(PSI, pod_psi) or driving(REFAULT, pod_refaults)
    memcg = not own
    node = choice == "auto" and not own and not driving(PRESSURE_LEVEL, memcg_events)
    return Counting(memcg=memcg, node=node)


def counting_on(config: Callable[[], LadderSections], host: HostInfo) -> Callable[[], Counting]:
    """:func:`counting` on this host with the configuration read each time, for the eviction
    manager's node-wide plugins as for the ladder."""
    memcg_events = not pressure_level_problem(host)
    return lambda: counting(config(), memcg_events, host.pod_psi, host.pod_refaults)


def rungs_of(cfg: LadderSections) -> list[Rung]:
    """The rungs switched on, least harmful first."""
    m = cfg.mitigation
    if not (cfg.reconciler.enabled and m.enabled):
        return []
    specs = {"taint": (m.taint.enabled, m.taint.level, None),
             "tune": (m.tune.enabled, m.tune.level, m.tune.repeat_s),
             "drop_cache": (m.drop_cache.enabled, m.drop_cache.level, m.drop_cache.repeat_s),
             "evict": (m.evict.enabled, m.evict.level, m.evict.repeat_s)}
    return [Rung(name, LEVEL_BY_NAME[level], repeat) for name in RUNGS
            for enabled, level, repeat in [specs[name]] if enabled]


def dry_run_of(cfg: MitigationConfig, rung: str) -> bool:
    return bool({"taint": cfg.taint.dry_run, "tune": cfg.tune.dry_run,
                 "drop_cache": cfg.drop_cache.dry_run, "evict": cfg.evict.dry_run}[rung])


@dataclass(frozen=True, slots=True)
class LadderState:
    """What the ladder is doing, for status and metrics."""

    level: Level
    cause: str
    engaged: tuple[str, ...]
    # Rungs whose release has not been confirmed yet (it is retried).
    releasing: tuple[str, ...]
    # rung -> (step, result, detail) of its last finished step
    last: Mapping[str, tuple[str, str, str]]


class _RungRunner:
    """One rung's steps, one at a time; only the latest waiting step is kept."""

    def __init__(self, name: str, action: Action, finish: Callable[[str, Step, Cause, bool,
                                                                     Result], None]) -> None:
        self.name = name
        self._action = action
        self._finish = finish
        self._pending: tuple[Step, Cause, bool] | None = None
        self.task: asyncio.Task[None] | None = None

    def submit(self, step: Step, cause: Cause, dry_run: bool, group: asyncio.TaskGroup) -> None:
        self._pending = (step, cause, dry_run)
        if self.task is None or self.task.done():
            self.task = group.create_task(self._drain(), name=f"mitigation-{self.name}")

    async def _drain(self) -> None:
        while self._pending is not None:
            step, cause, dry_run = self._pending
            self._pending = None
            call = {Step.ENGAGE: self._action.engage, Step.REPEAT: self._action.repeat,
                    Step.RELEASE: self._action.release}[step]
            try:
                result = await call(cause, dry_run)
            except Exception as exc:  # an action's bug must not end the ladder
                log.exception("mitigation_action_failed", action=self.name, step=str(step))
                result = Result(FAILED, f"{type(exc).__name__}: {exc}")
            self._finish(self.name, step, cause, dry_run, result)


class Mitigation:
    def __init__(self, config: Callable[[], LadderSections], board: Board,
                 actions: Mapping[str, Action], audit: AuditLog,
                 clock: Callable[[], float] | None = None,
                 close: Callable[[], None] = lambda: None,
                 metrics: ReconcilerMetrics | None = None,
                 taints: Callable[[], list[PlacedTaint]] = list,
                 counted: Callable[[], Counting] | None = None) -> None:
        self._config = config
        # Which kinds of reading count now (counting_on for the host; None: a host with
        # none of the memcg pressure events, per-pod PSI or per-pod refaults).
        self._counted = counted or (lambda: counting(config(), False, False, False))
        self._metrics = metrics
        # The taints the ladder has on the node now (for status).
        self.taints = taints
        self._close = close
        self._board = board
        self._actions = actions
        self._audit = audit
        self._clock = clock
        self._ladder = Ladder()
        self._level = Level.NONE
        self._cause = Cause(Level.NONE)
        self._last_known: dict[tuple[str, str], Level] = {}
        self._last: dict[str, tuple[str, str, str]] = {}
        # rung -> the dry run its last engage or repeat was submitted with, while engaged
        self._modes: dict[str, bool] = {}
        # Engaged rungs in dry run whose undo after the switch is not confirmed yet.
        self._undoing: set[str] = set()
        # Set while running: the clock, and the wake-up of the loop after a step's result.
        self._now: Callable[[], float] = lambda: 0.0
        self._wake: Callable[[], None] = lambda: None

    def state(self) -> LadderState:
        return LadderState(self._level, self._cause.text(), self._ladder.engaged,
                           self._ladder.releasing, dict(self._last))

    def engaged(self) -> bool:
        """Whether the ladder owns the node: a rung engaged, or one whose release is not
        confirmed yet. Safe from any thread (the ladder's tuples are taken whole)."""
        return bool(self._ladder.engaged or self._ladder.releasing)

    def assess(self) -> Cause:
        """The ladder's level and its cause from the board now. Of readings at the worst
        level, one whose latest sample is itself at that level (fresh pressure) is preferred to
        one held there by hysteresis: a repeated step acts on fresh pressure only."""
        cfg = self._config()
        wanted = set(cfg.mitigation.detectors)
        counted = self._counted()
        worst: Reading | None = None
        worst_rank = (Level.NONE, False)
        readings = self._board.current()
        for reading in readings:
            if reading.detector not in wanted or not counted.counts(reading):
                continue
            level = reading.level
            fresh = reading.fresh
            if level is Level.UNKNOWN:
                level, fresh = self._last_known.get(reading.key, Level.NONE), False
            else:
                self._last_known[reading.key] = level
            if level > Level.NONE and (level, fresh) > worst_rank:
                worst, worst_rank = reading, (level, fresh)
        worst_level = worst_rank[0]
        present = {r.key for r in readings}
        for key in [k for k in self._last_known if k not in present]:
            del self._last_known[key]
        return Cause(worst_level, worst)

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        clock = self._clock or loop.time
        changed = asyncio.Event()
        unsubscribe = self._board.subscribe(waker(loop, changed))
        self._now, self._wake = clock, changed.set
        runners = {name: _RungRunner(name, action, self._finished)
                   for name, action in self._actions.items()}
        try:
            async with asyncio.TaskGroup() as group:
                self.evaluate(clock(), runners, group)
                self._clear_leftovers(runners, group)
                while not stop.is_set():
                    changed.clear()
                    now = clock()
                    self.evaluate(now, runners, group)
                    cfg = self._config()
                    due = self._ladder.next_due(rungs_of(cfg), cfg.mitigation.cooldown_s)
                    wait = IDLE_RECHECK_S if due is None else min(max(due - now, 0.0),
                                                                  IDLE_RECHECK_S)
                    await sleep_until(wait, stop, changed)
                for runner in runners.values():
                    if runner.task is not None:
                        runner.task.cancel()
        finally:
            unsubscribe()
            # Off the event loop: the tune rung's restore waits for its write in flight.
            await asyncio.to_thread(self._close)

    def evaluate(self, now: float, runners: Mapping[str, _RungRunner],
                 group: asyncio.TaskGroup) -> None:
        cfg = self._config()
        cause = self.assess()
        if cause.level != self._level:
            log.info("mitigation_level", level=cause.level.name.lower(),
                     previous=self._level.name.lower(), reason=cause.text())
            self._audit.record("mitigation_level", ladder_level=cause.level.name.lower(),
                               previous=self._level.name.lower(), reason=cause.text())
            self._level = cause.level
            if self._metrics is not None:
                self._metrics.ladder_level(int(cause.level))
        self._cause = cause
        due = dict(self._ladder.step(cause.level, now, rungs_of(cfg), cfg.mitigation.cooldown_s))
        for name in self._ladder.engaged:
            # An engaged rung whose dry run was switched while the level holds (a reload, or
            # the node switched between observe and enforce): into dry run, what it placed is
            # undone now, not when the pressure ends; out of it, it acts now. The ladder keeps
            # it engaged either way; a repeat due now is the step that switches.
            was = self._modes.get(name)
            if was is not None and was != dry_run_of(cfg.mitigation, name) \
                    and due.get(name, Step.REPEAT) is Step.REPEAT:
                due[name] = Step.ENGAGE
        for name, step in due.items():
            runner = runners.get(name)
            dry_run = dry_run_of(cfg.mitigation, name)
            step_cause = cause
            if step is Step.RELEASE:
                self._modes.pop(name, None)
                self._undoing.discard(name)
            else:
                switched = self._modes.get(name) not in (None, dry_run)
                self._modes[name] = dry_run
                if dry_run and (switched or name in self._undoing):
                    # A release in dry run undoes only what this agent placed; one refused is
                    # tried again in the place of the engage the ladder retries.
                    step, step_cause = Step.RELEASE, Cause(
                        cause.level, None, "the rung switched to dry run: what it placed goes")
                    self._undoing.add(name)
                else:
                    self._undoing.discard(name)
            if runner is not None:
                runner.submit(step, step_cause, dry_run, group)
            else:
                # No action for the rung: nothing to confirm, nothing to retry.
                self._ladder.finished(name, step, True, now, Backoff(
                    cfg.mitigation.retry_initial_s, cfg.mitigation.retry_max_s))

    def _clear_leftovers(self, runners: Mapping[str, _RungRunner],
                         group: asyncio.TaskGroup) -> None:
        """Release, once at start, every rung the ladder does not hold, switched on or not: a
        taint or condition left by an earlier run of the agent (a crash, an upgrade, a rung
        switched off since) would otherwise stay until pressure came and went. Releases are
        idempotent (usually nothing changes) and retried until they succeed; a rung in dry run
        (every rung in observe mode) still undoes what the state file says this agent placed."""
        cfg = self._config()
        cause = Cause(Level.NONE, None, "start: clearing what an earlier run may have left")
        for name, step in self._ladder.release_leftovers(runners):
            runners[name].submit(step, cause, dry_run_of(cfg.mitigation, name), group)

    def _finished(self, name: str, step: Step, cause: Cause, dry_run: bool,
                  result: Result) -> None:
        self._last[name] = (str(step), result.result, result.detail)
        m = self._config().mitigation
        ok = result.result not in UNCONFIRMED
        backoff = Backoff(m.retry_initial_s, m.retry_max_s)
        self._ladder.finished(name, step, ok, self._now(), backoff)
        if step is Step.RELEASE and name in self._undoing:
            if ok or name not in self._ladder.engaged:
                self._undoing.discard(name)
                # Undone: the retries' backoff starts afresh.
                self._ladder.finished(name, Step.ENGAGE, True, self._now(), backoff)
            else:
                # Still engaged, so no release of the ladder's own retries it: its retry of a
                # failed engage, after the same backoff, becomes this undo again.
                self._ladder.finished(name, Step.ENGAGE, False, self._now(), backoff)
        self._wake()
        reading = cause.reading
        self._audit.record(
            "mitigation_action", action=name, step=str(step),
            ladder_level=cause.level.name.lower(),
            result=result.result, dry_run=dry_run, reason=cause.text(), detail=result.detail,
            detector=reading.detector if reading else None,
            scope=reading.scope if reading else None,
            value=reading.value if reading else None,
            threshold=reading.threshold if reading else None)


def build_mitigation(config: Callable[[], LadderSections], board: Board, state: NodeState,
                     sysfs: SysFs, host: HostInfo, audit: AuditLog, *, kube: KubeActions,
                     node: str, squeeze: GuardSqueeze, evictor: Evictor | None,
                     managed: ManagedCache, metrics: ReconcilerMetrics | None = None,
                     notes: StateFile | None = None) -> Mitigation:
    """The ladder with its four actions for this host. ``kube`` without API access: the taint
    rung is audited as skipped; ``evictor`` None: no eviction manager (audited "no
    evictor"); ``managed``: the running containers' cache the loops share, read by the one pod
    index of the actions; ``notes``: the agent's state file (what to restore)."""
    taint = TaintAction(config, kube, node, audit, metrics, notes)
    pods = PodIndex(state, host.cgroup, managed)
    drop_cache = DropCacheAction(config, sysfs, host, pods, audit, metrics=metrics)
    tune = TuneAction(config, squeeze, sysfs, host, pods, lambda: config().reconciler.enabled,
                      notes, metrics=metrics, audit=audit)
    actions: dict[str, Action] = {
        "taint": taint,
        "tune": tune,
        "drop_cache": drop_cache,
        "evict": EvictAction(evictor),
    }

    def close() -> None:
        drop_cache.close()
        tune.close()

    return Mitigation(config, board, actions, audit, close=close, metrics=metrics,
                      taints=taint.placed, counted=counting_on(config, host))
