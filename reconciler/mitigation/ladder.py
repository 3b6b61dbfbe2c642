"""The ladder: which rungs are engaged, from the worst level over time. Pure; time is passed in.

A rung acts from its level up: it is **engaged** as soon as the level reaches it (escalation
is never delayed: the detectors already smoothed their signals), **repeated** every
``repeat_s`` while the level holds (for actions whose effect wears off, such as dropped caches
refilling), and **released** once the level has stayed below it for the cooldown (so a level
that flaps faster than the cooldown keeps the rung engaged instead of toggling it). Rungs are
engaged least harmful first and released most harmful first. A rung that disappears from the
configuration (switched off) is released at once, and then forgotten.

Each step's outcome comes back (:meth:`Ladder.finished`): a step that failed is not taken for
done. A failed engage is tried again while the level holds, a failed release until it succeeds
(a taint left on the node would keep pods off it for good), each after a wait that doubles from
``retry_initial_s`` up to ``retry_max_s``. A rung being released that the level reaches again is
engaged anew.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reconciler.detection.signals import Level


class Step(enum.StrEnum):
    ENGAGE = "engage"
    REPEAT = "repeat"
    RELEASE = "release"


@dataclass(frozen=True, slots=True)
class Rung:
    name: str
    level: Level
    # Run again this often while engaged and the level holds; None: once per engagement.
    repeat_s: float | None = None


@dataclass(frozen=True, slots=True)
class Backoff:
    """Waits before a failed step is tried again: doubling from ``initial_s`` to ``max_s``."""

    initial_s: float
    max_s: float

    def after(self, previous_s: float) -> float:
        return self.initial_s if previous_s <= 0 else min(previous_s * 2, self.max_s)


@dataclass(slots=True)
class _Engaged:
    last_run: float
    # When the level first fell below the rung's level (None while it holds).
    below_since: float | None = None
    # The last engage failed: tried again at this time (None: nothing to retry).
    retry_at: float | None = None
    wait_s: float = 0.0


@dataclass(slots=True)
class _Releasing:
    # The failed release is tried again at this time; None while a release is under way.
    retry_at: float | None = None
    wait_s: float = 0.0


class Ladder:
    def __init__(self) -> None:
        self._engaged: dict[str, _Engaged] = {}
        self._releasing: dict[str, _Releasing] = {}

    @property
    def engaged(self) -> tuple[str, ...]:
        return tuple(self._engaged)

    @property
    def releasing(self) -> tuple[str, ...]:
        """Rungs whose release has not been confirmed yet."""
        return tuple(self._releasing)

    def release_leftovers(self, names: Iterable[str]) -> list[tuple[str, Step]]:
        """Releases of ``names`` (those not engaged) at start, tracked like any release: what
        an earlier run left is undone, and retried until it is."""
        steps = []
        for name in names:
            if name not in self._engaged and name not in self._releasing:
                self._releasing[name] = _Releasing()
                steps.append((name, Step.RELEASE))
        return steps

    def step(self, level: Level, now: float, rungs: Sequence[Rung],
             cooldown_s: float) -> list[tuple[str, Step]]:
        """The steps due at ``now`` for ``level``; ``rungs`` least harmful first."""
        engage: list[tuple[str, Step]] = []
        release: list[tuple[str, Step]] = []
        configured = {r.name for r in rungs}
        for name in [n for n in self._engaged if n not in configured]:
            self._release(name, release)
        for name, pending in self._releasing.items():
            if name not in configured and pending.retry_at is not None \
                    and now >= pending.retry_at:
                pending.retry_at = None
                release.append((name, Step.RELEASE))
        for rung in rungs:
            state = self._engaged.get(rung.name)
            if level >= rung.level:
                if state is None:
                    self._releasing.pop(rung.name, None)
                    self._engaged[rung.name] = _Engaged(now)
                    engage.append((rung.name, Step.ENGAGE))
                    continue
                state.below_since = None
                if state.retry_at is not None:
                    if now >= state.retry_at:
                        state.retry_at = None
                        state.last_run = now
                        engage.append((rung.name, Step.ENGAGE))
                elif rung.repeat_s is not None and now - state.last_run >= rung.repeat_s:
                    state.last_run = now
                    engage.append((rung.name, Step.REPEAT))
            elif state is not None:
                if state.below_since is None:
                    state.below_since = now
                if now - state.below_since >= cooldown_s:
                    self._release(rung.name, release)
            else:
                waiting = self._releasing.get(rung.name)
                if waiting is not None and waiting.retry_at is not None \
                        and now >= waiting.retry_at:
                    waiting.retry_at = None
                    release.append((rung.name, Step.RELEASE))
        return engage + release[::-1]

    def _release(self, name: str, release: list[tuple[str, Step]]) -> None:
        del self._engaged[name]
        self._releasing[name] = _Releasing()
        release.append((name, Step.RELEASE))

    def finished(self, name: str, step: Step, ok: bool, now: float, backoff: Backoff) -> None:
        """A step's outcome: ``ok`` once its effect is confirmed (or there is nothing to do)."""
        if step is Step.RELEASE:
            pending = self._releasing.get(name)
            if pending is None or pending.retry_at is not None:
                return
            if ok:
                del self._releasing[name]
            else:
                pending.wait_s = backoff.after(pending.wait_s)
                pending.retry_at = now + pending.wait_s
            return
        state = self._engaged.get(name)
        if state is None:
            return
        if ok:
            state.retry_at, state.wait_s = None, 0.0
        elif step is Step.ENGAGE:
            state.wait_s = backoff.after(state.wait_s)
            state.retry_at = now + state.wait_s

    def next_due(self, rungs: Sequence[Rung], cooldown_s: float) -> float | None:
        """The earliest time a repeat, a retry or a release falls due (None: nothing is
        pending)."""
        times: list[float] = [p.retry_at for p in self._releasing.values()
                              if p.retry_at is not None]
        for rung in rungs:
            state = self._engaged.get(rung.name)
            if state is None:
                continue
            if state.below_since is not None:
                times.append(state.below_since + cooldown_s)
            elif state.retry_at is not None:
                times.append(state.retry_at)
            elif rung.repeat_s is not None:
                times.append(state.last_run + rung.repeat_s)
        return min(times, default=None)
