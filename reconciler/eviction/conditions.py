"""Node conditions that eviction plugins report: true as soon as one is met, false after
``condition_transition_s`` without being met, audited when they change and written to the
Node (unless dry-run), with a backoff while the API server refuses.

A condition is noted in the state file before it is written True, and forgotten once written
False or taken off the node: an out-of-tree plugin's condition is in no list of the agent's, so
without the note a run cut short would leave it True for good, unknown to the next run (which
sets it False, or takes it off with the manager switched off) and to ``nri-qos reset``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from common.aio import Backoff
from common.audit import AuditLog
from hooks.untrusted import bounded
from reconciler.eviction.api import EvictionPlugin, EvictPods, ThresholdMet
from reconciler.eviction.config import EvictionConfig
from reconciler.eviction.smoothing import ConditionTracker
from reconciler.host.statefile import StateFile
from reconciler.kube import KubeActions, NodeOutcome

CONDITION_MET = "NriQosThresholdMet"
CONDITION_NOT_MET = "NriQosThresholdNotMet"
# Conditions kept at most: far above what the in-tree and any sane set of out-of-tree plugins
# use; a plugin inventing names cannot make the agent grow without bound.
MAX_CONDITIONS = 32
EVICTION_CONDITION_NOTES = "eviction_condition"
"""The state file's section: node condition the eviction manager wrote True -> its plugin."""


@dataclass(slots=True)
class _Condition:
    plugin: str
    status: bool | None = None
    written: bool | None = None
    message: str = ""
    next_try: float = 0.0
    backoff: Backoff | None = None


def _reason(status: bool) -> str:
    return CONDITION_MET if status else CONDITION_NOT_MET


class NodeConditions:
    """Each condition belongs to the first plugin that reported it. ``dry(plugin, cfg)``:
    whether that plugin's effects are only audited. ``notes``: the agent's state file; the
    conditions an earlier run wrote True and did not take back are this run's from the start."""

    def __init__(self, actions: KubeActions, node: str, audit: AuditLog,
                 dry: Callable[[str, EvictionConfig], bool],
                 notes: StateFile | None = None) -> None:
        self._actions = actions
        self._node = node
        self._audit = audit
        self._dry = dry
        self._notes = notes if notes is not None else StateFile(None)
        self._tracker = ConditionTracker()
        self._conditions: dict[str, _Condition] = {
            name: _Condition(plugin, written=True) for name, plugin in
            list(self._notes.entries(EVICTION_CONDITION_NOTES).items())[:MAX_CONDITIONS]}
        # While the manager is off: when its conditions may be tried again, and how long after.
        self._withdraw_at = 0.0
        self._withdraw_backoff: Backoff | None = None

    async def keep(self, plugins: Sequence[EvictionPlugin],
                   thresholds: Mapping[str, ThresholdMet], evicts: Mapping[str, EvictPods],
                   cfg: EvictionConfig, now: float) -> None:
        """This round's answers: the conditions they report, audited and written."""
        reported = self._reported(plugins, thresholds, evicts)
        for name, state in self._conditions.items():
            met, message = reported.get(name, (False, ""))
            status = self._tracker.observe(name, met, now, cfg.condition_transition_s)
            dry = self._dry(state.plugin, cfg)
            if status != state.status:
                state.status = status
                state.message = bounded(message, 256) if status else (
                    f"{state.plugin}: not met for {cfg.condition_transition_s:g} s")
                self._audit.record("eviction_condition", node=self._node, condition=name,
                                   status=status, reason=_reason(status),
                                   plugin=state.plugin, message=state.message, dry_run=dry)
            # A dry-run plugin writes nothing, but a condition this agent wrote True (before a
            # reload to dry run) is its own to take back once no longer met.
            undo = dry and state.written is True and not status
            if (dry and not undo) or not self._actions.available or status == state.written \
                    or now < state.next_try:
                continue
            if status:
                await self._notes.put_in_thread(EVICTION_CONDITION_NOTES, name, state.plugin)
            written = await self._actions.set_node_condition(
                self._node, name, status, _reason(status), state.message)
            if written in (NodeOutcome.CHANGED, NodeOutcome.UNCHANGED):
                state.written, state.backoff, state.next_try = status, None, 0.0
                if not status:
                    await self._notes.forget_in_thread(EVICTION_CONDITION_NOTES, name)
            else:
                state.backoff = state.backoff or Backoff(cfg.retry_initial_s, cfg.retry_max_s)
                state.next_try = now + state.backoff.next()

    async def withdraw(self, names: Sequence[str], cfg: EvictionConfig, now: float) -> bool:
        """The manager is switched off: nobody keeps its conditions true to the node any more,
        so they are taken off it, as an uninstall does: ``names`` (the in-tree ones, which an
        earlier run may have left), every one this run reported and every one noted. True once
        all are off (or there is no API to reach); a refusal is tried again after a backoff."""
        if not self._actions.available:
            return True
        if now < self._withdraw_at:
            return False
        left = []
        for name in dict.fromkeys([*names, *self._conditions]):
            outcome = await self._actions.remove_node_condition(self._node, name)
            if outcome is NodeOutcome.CHANGED:
                self._audit.record("eviction_condition_removed", node=self._node, condition=name,
                                   reason="eviction manager disabled")
            elif outcome is not NodeOutcome.UNCHANGED:
                left.append(name)
                continue
            await self._notes.forget_in_thread(EVICTION_CONDITION_NOTES, name)
        if left:
            self._withdraw_backoff = self._withdraw_backoff or Backoff(cfg.retry_initial_s,
                                                                       cfg.retry_max_s)
            self._withdraw_at = now + self._withdraw_backoff.next()
            return False
        # Switched on again, the manager starts from nothing, as at a start.
        self._conditions.clear()
        self._tracker = ConditionTracker()
        self._withdraw_at, self._withdraw_backoff = 0.0, None
        return True

    def settled(self) -> bool:
        """No condition is true and none waits for a write to be retried: rounds that find
        nothing met change nothing here."""
        return all(not state.status and state.backoff is None
                   for state in self._conditions.values())

    def _reported(self, plugins: Sequence[EvictionPlugin],
                  thresholds: Mapping[str, ThresholdMet], evicts: Mapping[str, EvictPods]
                  ) -> dict[str, tuple[bool, str]]:
        """condition -> (met, message) as this round's plugins report it."""
        reported: dict[str, tuple[bool, str]] = {}
        for plugin in plugins:
            threshold = thresholds.get(plugin.name)
            wanted = evicts.get(plugin.name)
            for condition, detail in (
                (threshold.condition if threshold else None,
                 threshold.describe() if threshold else ""),
                (wanted.condition if wanted else None, "pods to evict"),
            ):
                if condition is None:
                    continue
                owner = self._conditions.get(condition.name)
                if owner is not None and owner.plugin != plugin.name:
                    continue  # another plugin's condition: the first one keeps it
                if owner is None and len(self._conditions) >= MAX_CONDITIONS:
                    continue
                if owner is None:
                    self._conditions[condition.name] = _Condition(plugin.name)
                met, message = reported.get(condition.name, (False, ""))
                reported[condition.name] = (
                    met or condition.met, message if met else f"{plugin.name}: {detail}")
        return reported
