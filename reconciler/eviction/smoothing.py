"""Steadying what plugins report: hard-met only after a streak, conditions that do not flap.

* :class:`MetSmoother`: a plugin's threshold counts as hard-met only after it was reported
  hard-met in ``rounds`` consecutive rounds; anything less (or a round the plugin failed to
  answer) breaks the streak. Below the streak a hard-met report counts as soft-met, so the
  condition is raised at once while eviction waits.
* :class:`ConditionTracker`: a node condition turns true as soon as it is met, and false only
  once it has not been met for ``transition_s`` (kubelet's pressure-transition period): a signal
  flapping around its threshold keeps the condition steady instead of flapping the node.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from reconciler.eviction.api import MetType


class MetSmoother:
    def __init__(self) -> None:
        self._streaks: dict[str, int] = {}

    def observe(self, plugin: str, met: MetType | None, rounds: int) -> MetType:
        """The effective met type after this round's report (None: no answer this round)."""
        if met is MetType.HARD_MET:
            streak = self._streaks.get(plugin, 0) + 1
            self._streaks[plugin] = streak
            return MetType.HARD_MET if streak >= rounds else MetType.SOFT_MET
        self._streaks.pop(plugin, None)
        return met if met is not None else MetType.NOT_MET

    def keep_only(self, plugins: Iterable[str]) -> None:
        """Forget the streaks of plugins not in ``plugins`` (those no longer running)."""
        keep = set(plugins)
        for plugin in [p for p in self._streaks if p not in keep]:
            del self._streaks[plugin]


@dataclass
class _State:
    status: bool
    last_met: float | None


class ConditionTracker:
    def __init__(self) -> None:
        self._states: dict[str, _State] = {}

    def observe(self, name: str, met: bool, now: float, transition_s: float) -> bool:
        """The condition's status after this observation."""
        state = self._states.get(name)
        if met:
            if state is None:
                self._states[name] = _State(True, now)
            else:
                state.status, state.last_met = True, now
            return True
        if state is None:
            state = self._states[name] = _State(False, None)
        elif state.status and state.last_met is not None \
                and now - state.last_met >= transition_s:
            state.status = False
        return state.status

    def names(self) -> list[str]:
        return list(self._states)

    def status(self, name: str) -> bool | None:
        state = self._states.get(name)
        return None if state is None else state.status
