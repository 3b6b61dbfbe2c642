"""What each rung does: engage, repeat, release; each idempotent, each honouring dry-run: a
dry run writes nothing, except a release undoing what this agent is known to have placed (the
taint keys and conditions noted in the state file, the squeeze, the noted memory.wmark_ratio).

An action reports a :class:`Result` and never raises for an expected failure (no API access, a
refused write); the ladder's service audits every step with its cause (the detector, its value
and threshold) and result.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from common.audit import AuditLog
from hooks.levels import QosLevel
from hooks.units import quantity
from reconciler.detection.pods import PodIndex
from reconciler.detection.signals import Level, Reading
from reconciler.host.parse import ParseError
from reconciler.host.probe import HostInfo
from reconciler.host.statefile import StateFile, restore_noted
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.kube import KubeActions, NodeOutcome
from reconciler.loops.memory_guard import MemoryGuardConfig
from reconciler.loops.memory_squeeze import GuardSqueeze, Squeeze
from reconciler.metrics import ReconcilerMetrics
from reconciler.mitigation import relief
from reconciler.mitigation.config import MitigationConfig

log = structlog.get_logger("nri_qos.mitigation")

DONE = "done"
UNCHANGED = "unchanged"
DRY_RUN = "dry_run"
SKIPPED = "skipped"
FAILED = "failed"
TIMEOUT = "timeout"


@dataclass(frozen=True, slots=True)
class Cause:
    """Why the ladder acts: its level and the reading that set it."""

    level: Level
    reading: Reading | None = None
    # Said instead of the reading when there is none.
    note: str = "no detector reports pressure"

    def text(self) -> str:
        r = self.reading
        if r is None:
            return f"level {self.level.name.lower()}: {self.note}"
        return (f"level {self.level.name.lower()}: {r.detector} on {r.scope} at "
                f"{quantity(r.value, r.unit)}, threshold {quantity(r.threshold, r.unit)} "
                f"({r.reason})")


@dataclass(frozen=True, slots=True)
class Result:
    result: str
    detail: str = ""


class Action(Protocol):
    async def engage(self, cause: Cause, dry_run: bool) -> Result: ...

    async def repeat(self, cause: Cause, dry_run: bool) -> Result: ...

    async def release(self, cause: Cause, dry_run: bool) -> Result: ...


class Evictor(Protocol):
    """The eviction manager, as the ladder's last rung sees it."""

    def request_round(self, reason: str) -> None:
        """Run an eviction round now (the manager decides whom, and rate-limits)."""


class MitigationSections(Protocol):
    @property
    def mitigation(self) -> MitigationConfig: ...

    @property
    def memory_guard(self) -> MemoryGuardConfig: ...


def _node_result(outcomes: list[NodeOutcome], what: str) -> Result:
    if NodeOutcome.UNAVAILABLE in outcomes:
        return Result(SKIPPED, "no Kubernetes API access")
    if NodeOutcome.FAILED in outcomes:
        return Result(FAILED, f"{what}: the API refused or did not answer (see the log)")
    if NodeOutcome.CHANGED in outcomes:
        return Result(DONE, what)
    return Result(UNCHANGED, f"{what}: already so")


def _removal(keys: list[str], kinds: list[str]) -> str:
    """What a release of the taint rung does: ``remove taint k, C=False``."""
    parts = [f"remove taint {', '.join(keys)}"] if keys else []
    return ", ".join([*parts, *(f"{kind}=False" for kind in kinds)])


@dataclass(frozen=True, slots=True)
class PlacedTaint:
    """A taint this agent put on its node, as the API last confirmed it."""

    key: str
    value: str
    effect: str
    since: float  # by the event loop's clock


class TaintAction:
    """Forbid scheduling: the node taint and the node condition."""

    def __init__(self, config: Callable[[], MitigationSections], kube: KubeActions,
                 node: str, audit: AuditLog, metrics: ReconcilerMetrics | None = None,
                 notes: StateFile | None = None) -> None:
        self._config = config
        self._metrics = metrics
        self._placed: PlacedTaint | None = None
        # The taint keys and conditions this agent placed (this run or an earlier one): what
        # a release takes away, whatever the configuration names now.
        self._notes = notes if notes is not None else StateFile(None)
        self._kube = kube
        self._node = node
        self._audit = audit

    async def engage(self, cause: Cause, dry_run: bool) -> Result:
        rung = self._config().mitigation.taint
        what = f"taint {rung.key}:{rung.effect}, {rung.condition}=True"
        if (answer := self._without_writes(what, dry_run)) is not None:
            return answer
        reason = cause.text()
        # A key or condition changed while engaged: the old ones are ours too and must not
        # stay.
        outcomes = [await self._remove(key, reason)
                    for key in self._notes.entries(TAINT_NOTES) if key != rung.key]
        outcomes += [await self._clear(kind, reason)
                     for kind in self._notes.entries(CONDITION_NOTES) if kind != rung.condition]
        await self._notes.put_in_thread(TAINT_NOTES, rung.key, rung.effect)
        taint = await self._kube.add_taint(self._node, rung.key, rung.value, rung.effect,
                                           reason=reason)
        self._taint_is(rung.key, True, taint)
        if taint in (NodeOutcome.CHANGED, NodeOutcome.UNCHANGED) and (
                self._placed is None or self._placed.key != rung.key):
            self._placed = PlacedTaint(rung.key, rung.value, rung.effect,
                                       asyncio.get_running_loop().time())
        await self._notes.put_in_thread(CONDITION_NOTES, rung.condition, "True")
        condition = await self._condition(rung.condition, True, "MemoryInterference", reason)
        return _node_result([*outcomes, taint, condition], what)

    async def repeat(self, cause: Cause, dry_run: bool) -> Result:
        return await self.engage(cause, dry_run)

    async def release(self, cause: Cause, dry_run: bool) -> Result:
        """Removes every taint key this agent placed (noted in the state file, this run or an
        earlier one) and the configured one, and sets their conditions False. In dry run only
        the noted ones: undoing what this agent placed is never held back (a rung engaged while
        the node enforced must not stay after a reload to dry run or observe mode), but a key
        it is not known to have placed may be someone else's."""
        rung = self._config().mitigation.taint
        keys = list(self._notes.entries(TAINT_NOTES))
        kinds = list(self._notes.entries(CONDITION_NOTES))
        if not dry_run:
            keys = list(dict.fromkeys([*keys, rung.key]))
            kinds = list(dict.fromkeys([*kinds, rung.condition]))
        elif not keys and not kinds:
            return Result(DRY_RUN, f"would {_removal([rung.key], [rung.condition])}")
        if not self._kube.available:
            return Result(SKIPPED, "no Kubernetes API access")
        what = _removal(keys, kinds)
        if dry_run:
            what += " (placed by this agent: undone in dry run too)"
        reason = cause.text()
        outcomes = [await self._remove(key, reason) for key in keys]
        outcomes += [await self._clear(kind, reason) for kind in kinds]
        return _node_result(outcomes, what)

    def _without_writes(self, what: str, dry_run: bool) -> Result | None:
        """The answer of an engage that writes nothing: a dry run, or no API access; None when
        the writes go ahead."""
        if dry_run:
            return Result(DRY_RUN, f"would {what}")
        if not self._kube.available:
            return Result(SKIPPED, "no Kubernetes API access")
        return None

    async def _remove(self, key: str, reason: str) -> NodeOutcome:
        outcome = await self._kube.remove_taint(self._node, key, reason=reason)
        self._taint_is(key, False, outcome)
        if outcome in (NodeOutcome.CHANGED, NodeOutcome.UNCHANGED):
            await self._notes.forget_in_thread(TAINT_NOTES, key)
            if self._placed is not None and self._placed.key == key:
                self._placed = None
        return outcome

    async def _clear(self, kind: str, reason: str) -> NodeOutcome:
        outcome = await self._condition(kind, False, "NoMemoryInterference", reason)
        if outcome in (NodeOutcome.CHANGED, NodeOutcome.UNCHANGED):
            await self._notes.forget_in_thread(CONDITION_NOTES, kind)
        return outcome

    def placed(self) -> list[PlacedTaint]:
        """The taints this agent has on the node now (empty or one)."""
        return [] if self._placed is None else [self._placed]

    def _taint_is(self, key: str, present: bool, outcome: NodeOutcome) -> None:
        if self._metrics is not None and outcome in (NodeOutcome.CHANGED, NodeOutcome.UNCHANGED):
            self._metrics.taint(key, present)

    async def _condition(self, kind: str, status: bool, reason: str,
                         message: str) -> NodeOutcome:
        outcome = await self._kube.set_node_condition(self._node, kind, status, reason, message)
        if outcome is NodeOutcome.CHANGED:
            self._audit.record("node_condition", node=self._node, condition=kind,
                               status="True" if status else "False", reason=reason,
                               message=message)
        return outcome


class TuneAction:
    """Tune memcg: squeeze the reclaimed tier through the memory guard (v1 limit, v2
    memory.high) and, where the kernel has it, lower memory.wmark_ratio of reclaimed pods.

    With ``judge_s`` set, a squeeze engaged by an online pod's own reading is judged that long
    after (:mod:`reconciler.mitigation.relief`): one that did not relieve the pod is released
    and held off for ``futile_hold_s`` while the rung stays engaged."""

    def __init__(self, config: Callable[[], MitigationSections], squeeze: GuardSqueeze,
                 sysfs: SysFs, host: HostInfo, pods: PodIndex,
                 reconciler_enabled: Callable[[], bool],
                 notes: StateFile | None = None,
                 clock: Callable[[], float] | None = None,
                 metrics: ReconcilerMetrics | None = None,
                 audit: AuditLog | None = None) -> None:
        self._config = config
        self._audit = audit
        self._clock = clock
        self._metrics = metrics
        # The squeeze's start as the pod that engaged it saw it, until it is judged.
        self._mark: relief.Mark | None = None
        # A squeeze judged futile is not tried again before this time (the loop's clock).
        self._held_off_until: float | None = None
        self._squeeze = squeeze
        self._sysfs = sysfs
        self._pods = pods
        self._reconciler_enabled = reconciler_enabled
        self._wmark = host.memcg.wmark_ratio
        self._v2 = host.cgroup.v2
        # wmark_ratio file -> the value it had before the rung engaged, kept in the state file
        # so that a restart or nri-qos reset restores it too
        self._notes = notes if notes is not None else StateFile(None)
        # Held by a thread writing or restoring wmark_ratio files: a restore at stop must not
        # come between a note (on a slow disk, seconds) and the write it records.
        self._writing = threading.Lock()
        # Counts every squeeze asked for (engage, and each repeat on fresh pressure): a new
        # number tells the guard to take the tier a step lower.
        self._tightenings = 0
        target = "memory.high" if self._v2 else "memory limit"
        log.info("tune_memcg_variants", squeeze=f"the reclaimed tier's {target}",
                 wmark_ratio="reclaimed pods" if self._wmark else
                 "unavailable: the kernel has no memory.wmark_ratio (veLinux/Anolis only)")

    def _guard_on(self) -> bool:
        return self._reconciler_enabled() and self._config().memory_guard.enabled

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def engage(self, cause: Cause, dry_run: bool) -> Result:
        self._held_off_until = None
        return await self._start(cause, dry_run)

    async def _start(self, cause: Cause, dry_run: bool) -> Result:
        """A squeeze from the tier's usage, noted for judgment when a pod's reading asks."""
        result = await self._tighten(cause, dry_run, "below its usage")
        self._mark = None
        if result.result != DONE or not self._guard_on() or \
                self._config().mitigation.tune.judge_s <= 0 or not relief.judged(cause.reading):
            return result
        assert cause.reading is not None
        file = relief.pod_file(cause.reading.detector)
        text = await self._read_pod(cause.reading.pod_uid, file)
        try:
            if text is None:
                raise ParseError(f"the pod's {file} is not readable")
            self._mark = relief.mark(cause.reading, text, self._v2, self._now())
        except ParseError as exc:
            return Result(DONE, f"{result.detail}; not judged: {exc}")
        return result

    async def _read_pod(self, uid: str | None, file: str) -> str | None:
        """A file of the pod's memory cgroup; None when the pod or the file is gone."""
        pod = next((p.cgroup for p in self._pods.pods() if p.uid == uid), None)
        return None if pod is None else await asyncio.to_thread(self._sysfs.read,
                                                                  f"{pod}/{file}")

    async def _judge(self, start: relief.Mark) -> Result | None:
        """The verdict on the squeeze ``start`` began: None to keep it (relieved, or no
        verdict possible), else the result of releasing it."""
        rung = self._config().mitigation.tune
        now = self._now()
        self._mark = None
        text = await self._read_pod(start.pod_uid, start.file)
        try:
            squeezed = None if text is None else relief.during(start, text, self._v2, now)
        except ParseError as exc:
            log.info("squeeze_not_judged", pod=start.pod_uid, reason=str(exc))
            return None
        if squeezed is None:
            return None
        ok = relief.relieved(start.before, squeezed, rung.min_relief_percent)
        said = relief.verdict_text(start, squeezed, ok, rung.min_relief_percent,
                                   now - start.at)
        if self._metrics is not None:
            self._metrics.squeeze_judged(ok)
        if self._audit is not None:
            self._audit.record("squeeze_judged", pod_uid=start.pod_uid,
                               detector=start.detector, before=start.before,
                               during=round(squeezed, 3), unit=start.unit,
                               elapsed_s=round(now - start.at, 3),
                               verdict="relieved" if ok else "futile",
                               hold_s=0.0 if ok else rung.futile_hold_s)
        if ok:
            return None
        self._held_off_until = now + rung.futile_hold_s
        self._squeeze.set(None)
        await asyncio.to_thread(self._restore_wmark, f"squeeze futile: {said}")
        return Result(DONE, f"squeeze released for {rung.futile_hold_s:g} s: it did not "
                            f"relieve the pod: {said}")

    async def _tighten(self, cause: Cause, dry_run: bool, where: str) -> Result:
        rung = self._config().mitigation.tune
        parts = []
        guard = self._guard_on()
        target = "memory.high" if self._v2 else "limit"
        spare = not (self._v2 and rung.throttle_anonymous)  # v1's hard limit always spares
        if guard:
            spared = ", above its anonymous memory" if spare else ""
            parts.append(f"reclaimed tier {target} held {rung.squeeze_bytes} B {where} "
                         f"(floor {rung.floor_bytes} B{spared})")
        if self._wmark:
            parts.append(f"memory.wmark_ratio {rung.wmark_ratio} on reclaimed pods")
        if not parts:
            return Result(SKIPPED, "no knob: the memory guard is off and the kernel has no "
                                   "memory.wmark_ratio")
        what = "; ".join(parts)
        if dry_run:
            return Result(DRY_RUN, f"would set {what}")
        if guard:
            self._tightenings += 1
            self._squeeze.set(Squeeze(rung.squeeze_bytes, rung.floor_bytes, cause.text(),
                                      self._tightenings, spare_anonymous=spare))
        else:
            what += " (memory guard off: no squeeze)"
        if self._wmark:
            failed = await asyncio.to_thread(self._set_wmark, rung.wmark_ratio, cause.text())
            if failed:
                return Result(FAILED, f"{what}; wmark_ratio not written on {failed} pod(s)")
        return Result(DONE, what)

    async def repeat(self, cause: Cause, dry_run: bool) -> Result:
        """Judge the squeeze once it has held ``judge_s``; then tighten again only while the
        pressure is fresh: once the signal has dropped (its level only held by hysteresis), the
        tier stays where it is (a squeeze renewed every period would take the offline tier down
        to its floor after the pressure ended). A squeeze held off starts anew after the hold,
        on fresh pressure."""
        fresh = cause.reading is None or cause.reading.fresh
        if self._held_off_until is not None:
            if self._now() < self._held_off_until:
                return Result(UNCHANGED, "squeeze held off: it did not relieve the pod that "
                                         "engaged it")
            if not fresh:
                return Result(UNCHANGED, "squeeze held off until the pressure is fresh")
            self._held_off_until = None
            return await self._start(cause, dry_run)
        start = self._mark
        if start is not None and not dry_run and \
                self._now() - start.at >= self._config().mitigation.tune.judge_s:
            released = await self._judge(start)
            if released is not None:
                return released
        if not fresh:
            assert cause.reading is not None
            return Result(UNCHANGED, "held where it is: the pressure is no longer fresh "
                                     f"({cause.reading.reason})")
        return await self._tighten(cause, dry_run, "below the limit held")

    async def release(self, cause: Cause, dry_run: bool) -> Result:
        """Releases the squeeze and restores every noted memory.wmark_ratio, in dry run too:
        both are this rung's own, and a squeeze left set after a reload to dry run or observe
        mode would hold the tier down (on v1 with its OOM killer off) for good. With nothing of
        the rung's in place a dry run writes nothing."""
        self._mark, self._held_off_until = None, None
        if dry_run and self._squeeze.current() is None and not self._notes.entries(WMARK_NOTES):
            return Result(DRY_RUN, "would release the squeeze and restore memory.wmark_ratio")
        released = self._squeeze.set(None)
        restored = await asyncio.to_thread(self._restore_wmark, cause.text())
        left = len(self._notes.entries(WMARK_NOTES))
        if left:
            return Result(FAILED, f"squeeze released; wmark_ratio not restored on {left} "
                                  f"file(s)")
        if not released and not restored:
            return Result(UNCHANGED, "nothing was tuned")
        return Result(DONE, f"squeeze released; wmark_ratio restored on {restored} pod(s)")

    def _set_wmark(self, ratio: int, reason: str) -> int:
        failed = 0
        with self._writing:
            # Pods gone while the rung stays engaged (for days under lasting pressure) have
            # nothing to restore: their notes would fill the state file.
            for path in self._notes.entries(WMARK_NOTES):
                if not self._sysfs.exists(path):
                    self._notes.forget(WMARK_NOTES, path)
            for pod in self._pods.pods():
                if pod.level != QosLevel.RECLAIMED_CORES:
                    continue
                path = f"{pod.cgroup}/memory.wmark_ratio"
                current = self._sysfs.read(path)
                if current is None or \
                        not self._notes.remember(WMARK_NOTES, path, current.strip()):
                    continue
                outcome = self._sysfs.write_if_changed(path, str(ratio),
                                                       f"tune memcg: {reason}")
                failed += outcome is Outcome.FAILED
        return failed

    def _restore_wmark(self, reason: str) -> int:
        with self._writing:
            return restore_wmark(self._sysfs, self._notes, f"tune memcg released: {reason}")

    def close(self) -> None:
        """The agent stops: the reclaimed pods get their memory.wmark_ratio back, as the tier
        gets back what the squeeze took (the memory guard's close): nobody watches the pressure
        that lowered it any more. A write refused keeps its note for the next start or
        ``nri-qos reset``, as do the notes of a rung's write still running after
        :data:`TUNE_CLOSE_WAIT_S` (the ladder's end does not wait longer for a slow disk)."""
        if not self._writing.acquire(timeout=TUNE_CLOSE_WAIT_S):
            log.warning("wmark_ratio_restore_deferred", reason="a write of the tune rung is "
                        "still running: its notes stay for the next start or nri-qos reset")
            return
        try:
            restore_wmark(self._sysfs, self._notes, "tune memcg released: agent stopping")
        finally:
            self._writing.release()


TUNE_CLOSE_WAIT_S = 5.0
"""How long the ladder's end waits for a write of the tune rung still running (its note on a
slow disk) before it leaves the restore to the next start."""
WMARK_NOTES = "wmark_ratio"
"""The state file's section: memory.wmark_ratio file -> its value before the tune rung."""
TAINT_NOTES = "taint"
"""The state file's section: taint key this agent placed -> its effect."""
CONDITION_NOTES = "node_condition"
"""The state file's section: node condition this agent set True -> "True"."""


def restore_wmark(sysfs: SysFs, notes: StateFile, reason: str) -> int:
    """Writes back every memory.wmark_ratio the tune rung changed; how many were written."""
    return restore_noted(sysfs, notes, WMARK_NOTES, reason)


class EvictAction:
    """The last rung: ask the eviction manager for a round."""

    def __init__(self, evictor: Evictor | None) -> None:
        self._evictor = evictor

    async def engage(self, cause: Cause, dry_run: bool) -> Result:
        if dry_run:
            return Result(DRY_RUN, "would ask the eviction manager for a round")
        if self._evictor is None:
            return Result(SKIPPED, "no evictor")
        self._evictor.request_round(cause.text())
        return Result(DONE, "eviction round requested")

    async def repeat(self, cause: Cause, dry_run: bool) -> Result:
        return await self.engage(cause, dry_run)

    async def release(self, cause: Cause, dry_run: bool) -> Result:
        return Result(UNCHANGED, "nothing to undo")
