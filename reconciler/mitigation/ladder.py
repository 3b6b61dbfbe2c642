"""The ladder: which rungs are engaged, from the worst level over time. Pure; time is passed in.

A rung acts from its level up: it is **engaged** as soon as the level reaches it (escalation
is never delayed: the detectors already smoothed their signals), **repeated** every
``repeat_s`` while the level holds (for actions whose effect wears off, such as dropped caches
refilling), and **released** once the level has stayed below it for the cooldown (so a level
that flaps faster than the cooldown keeps the rung engaged instead of toggling it). Rungs are
engaged least harmful first and released most harmful first. A rung that disappears from the
configuration (switched off) is released at once.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
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


@dataclass(slots=True)
class _Engaged:
    last_run: float
    # When the level first fell below the rung's level (None while it holds).
    below_since: float | None = None


class Ladder:
    def __init__(self) -> None:
        self._engaged: dict[str, _Engaged] = {}

    @property
    def engaged(self) -> tuple[str, ...]:
        return tuple(self._engaged)

    def step(self, level: Level, now: float, rungs: Sequence[Rung],
             cooldown_s: float) -> list[tuple[str, Step]]:
        """The steps due at ``now`` for ``level``; ``rungs`` least harmful first."""
        engage: list[tuple[str, Step]] = []
        release: list[tuple[str, Step]] = []
        configured = {r.name for r in rungs}
        for name in [n for n in self._engaged if n not in configured]:
            del self._engaged[name]
            release.append((name, Step.RELEASE))
        for rung in rungs:
            state = self._engaged.get(rung.name)
            if level >= rung.level:
                if state is None:
                    self._engaged[rung.name] = _Engaged(now)
                    engage.append((rung.name, Step.ENGAGE))
                    continue
                state.below_since = None
                if rung.repeat_s is not None and now - state.last_run >= rung.repeat_s:
                    state.last_run = now
                    engage.append((rung.name, Step.REPEAT))
            elif state is not None:
                if state.below_since is None:
                    state.below_since = now
                if now - state.below_since >= cooldown_s:
                    del self._engaged[rung.name]
                    release.append((rung.name, Step.RELEASE))
        return engage + release[::-1]

    def next_due(self, rungs: Sequence[Rung], cooldown_s: float) -> float | None:
        """The earliest time a repeat or a release falls due (None: nothing is pending)."""
        times: list[float] = []
        for rung in rungs:
            state = self._engaged.get(rung.name)
            if state is None:
                continue
            if state.below_since is not None:
                times.append(state.below_since + cooldown_s)
            elif rung.repeat_s is not None:
                times.append(state.last_run + rung.repeat_s)
        return min(times, default=None)
