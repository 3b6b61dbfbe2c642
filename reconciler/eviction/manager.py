"""The eviction manager: the one place that decides which pods leave the node.

Every round (``[eviction] interval_s``; ``quiet_interval_s`` after a quiet round, one that had
nothing to act on; and at once when :meth:`EvictionManager.request_round` is called, the
mitigation ladder's evict rung, or a detector's level changes):

1. the plugin directory is rescanned; the plugins are the enabled in-tree ones, then the
   out-of-tree ones by name;
2. ``ThresholdMet`` and ``GetEvictPods`` are asked of every plugin at once, each call under the
   deadline; a plugin that misses it, fails or answers garbage is skipped for the round and
   audited (once per streak);
3. thresholds are smoothed (hard-met counts after ``met_rounds`` rounds in a row), node
   conditions kept (true at once, false after ``condition_transition_s`` without being met);
   plugins whose threshold is hard-met are asked ``GetTopEvictionPods`` among the pods the
   filter lets go;
4. proposals are filtered (:class:`~reconciler.eviction.choice.PodFilter`, pods in eviction,
   pods backing off after a refusal: :mod:`~reconciler.eviction.retries`), ranked
   (``sort_keys``), forced ones and hard-met targets first, then at most ``soft_per_round``
   soft candidates;
5. each chosen pod takes a token of the shared bucket, then is evicted through ``policy/v1``
   with an Event on the pod, or, in dry-run, only audited.

Nothing here blocks the event loop: plugin calls are awaited with deadlines, pod usage is read
in a worker thread, API calls run in threads inside :class:`~reconciler.kube.KubeActions`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from common.aio import Backoff, done_or_stopped, sleep_until, unless_stopped
from common.audit import AuditLog
from common.state import NodeState
from hooks.untrusted import bounded
from reconciler.eviction import proposals
from reconciler.eviction.api import (
    EvictionPlugin,
    MetType,
)
from reconciler.eviction.builtin import IN_TREE_CONDITIONS
from reconciler.eviction.calls import PluginCalls
from reconciler.eviction.choice import PodFilter
from reconciler.eviction.conditions import NodeConditions
from reconciler.eviction.config import EvictionConfig
from reconciler.eviction.facts import pod_facts
from reconciler.eviction.once import RoundAudit
from reconciler.eviction.owners import OwnerCheck
from reconciler.eviction.proposals import Answers, Candidate, Flight
from reconciler.eviction.ratelimit import TokenBucket
from reconciler.eviction.remote import PluginDirectory
from reconciler.eviction.retries import Retries
from reconciler.eviction.smoothing import MetSmoother
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.kube import EvictionOutcome, KubeActions, PodRef
from reconciler.loops.base import ReconcilerConfig
from reconciler.metrics import ReconcilerMetrics

log = structlog.get_logger("nri_qos.eviction")

EVENT_REASON = "NriQosEvicted"
RECENT_KEPT = 20
"""Decisions kept for ``nri-qos status``."""
WITHDRAW_STOP_WAIT_S = 2.0
"""How long a stop waits for the withdrawal of the conditions under way (manager switched off)."""

class EvictionSections(Protocol):
    @property
    def reconciler(self) -> ReconcilerConfig: ...

    @property
    def eviction(self) -> EvictionConfig: ...


class Outcome(enum.StrEnum):
    """What became of a chosen pod in a round."""

    DRY_RUN = "dry_run"
    EVICTED = "evicted"
    BLOCKED = "blocked"
    GONE = "gone"
    FAILED = "failed"
    UNAVAILABLE = "unavailable"
    RATE_LIMITED = "rate_limited"
    # Not asked for: the API server throttled an earlier eviction of the round.
    THROTTLED = "throttled"


@dataclass(frozen=True, slots=True)
class Decision:
    pod: str
    plugin: str
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Recent:
    """A pod chosen for eviction (rate-limited ones are not: they are chosen again later)."""

    at: float
    pod: str
    plugin: str
    outcome: Outcome
    reason: str


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What one round did: every chosen pod and its outcome, in order."""

    decisions: tuple[Decision, ...] = ()
    # Nothing can come of the next round unless something changes: no out-of-tree plugin (it
    # decides from its own data), every plugin answered, none met or proposed a pod, no
    # condition true, no refused eviction waiting.
    quiet: bool = False


class EvictionManager:
    """See the module doc. ``in_tree``: every in-tree plugin by name (``[eviction] plugins``
    chooses which run); ``node``: this node's name, for Events and conditions; ``changes``:
    subscribes a callback (called from any thread) to changes of what the in-tree plugins read
    (the detectors' levels), which end a quiet wait at once; ``notes``: the agent's state file
    (the node conditions written True)."""

    def __init__(self, config: Callable[[], EvictionSections], state: NodeState,
                 actions: KubeActions, node: str, audit: AuditLog, sysfs: SysFs,
                 layout: CgroupLayout, in_tree: Mapping[str, EvictionPlugin], *,
                 clock: Callable[[], float] | None = None,
                 metrics: ReconcilerMetrics | None = None,
                 changes: Callable[[Callable[[], None]], Callable[[], None]] | None = None,
                 notes: StateFile | None = None) -> None:
        self._config = config
        self._changes = changes
        self._metrics = metrics
        self._recent: collections.deque[Recent] = collections.deque(maxlen=RECENT_KEPT)
        self._state = state
        self._actions = actions
        self._node = node
        self._audit = audit
        self._sysfs = sysfs
        self._layout = layout
        self._in_tree = dict(in_tree)
        self._clock = clock
        cfg = config().eviction
        self._directory = PluginDirectory(audit, lambda: self._config().eviction.call_timeout_s)
        self._bucket: TokenBucket | None = None
        self._filter = PodFilter(cfg)
        self._met = MetSmoother()
        self._conditions = NodeConditions(actions, node, audit, proposals.is_dry, notes)
        self._flights: dict[str, Flight] = {}
        self._retries = Retries()
        self._calls = PluginCalls(audit)
        self._once = RoundAudit(audit)
        self._told_unavailable = False
        # The manager is off and its node conditions are off the node.
        self._withdrawn = False
        # Until when the API server's Retry-After on a throttled eviction holds every eviction.
        self._throttled_until = -math.inf
        self._owners = OwnerCheck(actions)
        self._requests: collections.deque[str] = collections.deque(maxlen=64)
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- the loop ---------------------------------------------------------------------------

    def request_round(self, reason: str) -> None:
        """Run a round now (safe from any thread); the ladder's evict rung calls this."""
        self._requests.append(reason)
        self._wake_up()

    def _wake_up(self) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the manager is gone
                loop.call_soon_threadsafe(self._wake.set)

    async def run(self, stop: asyncio.Event) -> None:
        """Rounds until ``stop`` is set; a round that fails is logged and retried later."""
        self._loop = asyncio.get_running_loop()
        backoff: Backoff | None = None
        unsubscribe = self._changes(self._wake_up) if self._changes is not None else None
        try:
            while not stop.is_set():
                sections = self._config()
                cfg = sections.eviction
                delay = cfg.interval_s
                # Cleared before the round: a wake-up while it runs starts the next at once.
                self._wake.clear()
                # A reload that switches the reconciler off switches the manager off with the
                # rest of the background half, its node conditions with it.
                if cfg.enabled and sections.reconciler.enabled:
                    self._withdrawn = False
                    # A round can wait on a slow API server for many request timeouts in a
                    # row: a stop cancels it rather than waiting for its end.
                    current = asyncio.ensure_future(self.run_round())
                    try:
                        if not await done_or_stopped(current, stop):
                            return
                        report = current.result()
                        backoff = None
                        if report.quiet:
                            delay = max(delay, cfg.quiet_interval_s)
                    except Exception as exc:  # the next round starts clean
                        backoff = backoff or Backoff(cfg.interval_s * 2, 60.0)
                        delay = backoff.next()
                        log.warning("eviction_round_failed", error=repr(exc),
                                    retry_in_s=delay, exc_info=True)
                    finally:
                        current.cancel()
                        await asyncio.wait({current})
                else:
                    await self._directory.close()
                    if not self._withdrawn:
                        # A stop waits a little for writes under way, not for an API server
                        # holding them up (what is not withdrawn stays noted).
                        withdrawn = await unless_stopped(self._conditions.withdraw(
                            IN_TREE_CONDITIONS, cfg, self._now()), stop, WITHDRAW_STOP_WAIT_S)
                        if withdrawn is None:
                            return
                        self._withdrawn = withdrawn
                await sleep_until(delay, stop, self._wake)
        finally:
            if unsubscribe is not None:
                unsubscribe()
            self._loop = None
            await self.close()

    async def close(self) -> None:
        """Closes the channels to out-of-tree plugins (:meth:`run` does it when it ends)."""
        await self._directory.close()

    def recent(self) -> list[tuple[float, Recent]]:
        """The latest decisions, newest first (at most :data:`RECENT_KEPT`), each with its age
        in seconds by the manager's clock."""
        now = self._now()
        return [(now - r.at, r) for r in reversed(self._recent)]

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    # ---- one round --------------------------------------------------------------------------

    async def run_round(self) -> RoundReport:
        cfg = self._config().eviction
        now = self._now()
        while self._requests:
            log.info("eviction_round_requested", reason=bounded(self._requests.popleft()))
        if self._filter.cfg is not cfg:
            self._filter = PodFilter(cfg)
        if self._bucket is None:
            self._bucket = TokenBucket(cfg.rate_burst, cfg.rate_interval_s, now)
        self._bucket.configure(cfg.rate_burst, cfg.rate_interval_s, now)
        remote = await self._directory.scan(cfg.plugin_dir, reserved=self._in_tree)
        plugins: list[EvictionPlugin] = [self._in_tree[name] for name in cfg.plugins
                                         if name in self._in_tree]
        plugins += remote
        names = [p.name for p in plugins]
        self._calls.keep_only(names)
        self._met.keep_only(names)

        snapshot = self._state.snapshot()
        facts = await asyncio.to_thread(pod_facts, snapshot, self._sysfs, self._layout)
        proposals.forget_left(self._flights, self._retries, facts, cfg, now)
        active = [f.pod for uid, f in facts.items()
                  if not f.terminating and uid not in self._flights]
        self._once.start_round()

        answers = Answers()
        deadline = cfg.call_timeout_s
        async with asyncio.TaskGroup() as group:
            for plugin in plugins:
                group.create_task(self._calls.ask(plugin, "ThresholdMet", plugin.threshold_met,
                                            deadline, answers.threshold))
                group.create_task(self._calls.ask(plugin, "GetEvictPods",
                                            functools.partial(plugin.get_evict_pods, active),
                                            deadline, answers.evict))
        hard = []
        for plugin in plugins:
            answer = answers.threshold.get(plugin.name)
            met = self._met.observe(plugin.name, None if answer is None else answer.met,
                                    cfg.met_rounds)
            if met is MetType.HARD_MET and answer is not None:
                hard.append((plugin, answer))
        await self._conditions.keep(plugins, answers.threshold, answers.evict, cfg, now)
        if hard:
            # Only the pods the filter lets go (OwnerCheck.evictable says why).
            evictable = await self._owners.evictable(active, facts, functools.partial(
                self._filter.why_not, need_description=self._actions.available), now)
            async with asyncio.TaskGroup() as group:
                for plugin, answer in hard:
                    group.create_task(self._calls.ask(
                        plugin, "GetTopEvictionPods",
                        functools.partial(plugin.get_top_eviction_pods, evictable, cfg.top_n,
                                          answer.scope),
                        deadline, answers.top))
        proposed = {uid for plugin, _ in hard if plugin.name in answers.top
                    for uid in answers.top[plugin.name].uids}
        proposed |= {request.uid for wanted in answers.evict.values() for request in wanted.pods}
        facts = await self._owners.confirm(facts, proposed, now)
        candidates = proposals.candidates(plugins, hard, answers, facts, cfg, self._flights,
                                          self._filter, self._once,
                                          need_description=self._actions.available)
        chosen = proposals.choose(candidates, self._retries, self._once, cfg, now)
        decisions = await self._evict(chosen, cfg, now)
        self._once.end_round()
        quiet = not remote and not proposed and not self._retries.any_waiting(self._now()) \
            and self._conditions.settled() and answers.none_met(names)
        return RoundReport(tuple(decisions), quiet)

    # ---- evicting ---------------------------------------------------------------------------

    async def _evict(self, chosen: Sequence[Candidate], cfg: EvictionConfig,
                     now: float) -> list[Decision]:
        bucket = self._bucket
        assert bucket is not None
        if chosen and now < self._throttled_until:
            return self._defer(chosen, Outcome.THROTTLED, self._throttled_why(now))
        decisions = []
        for index, candidate in enumerate(chosen):
            pod, plugin = candidate.facts.pod, candidate.plugin
            if not bucket.take(now):
                decisions += self._defer(chosen[index:], Outcome.RATE_LIMITED,
                                         f"rate limit: next token in {bucket.wait(now):.1f} s")
                break
            # Also the configuration in force now: the evictions before this one may have
            # taken their request timeouts, and a reload meanwhile (observe mode, dry run)
            # holds the ones not sent yet.
            dry = proposals.is_dry(plugin, cfg) or proposals.is_dry(plugin,
                                                                    self._config().eviction)
            self._audit.record("eviction_chosen", pod=pod.ref, plugin=plugin,
                               reason=candidate.reason, dry_run=dry, uid=pod.uid,
                               qos_level=pod.qos_level, priority=pod.priority,
                               memory_usage_bytes=pod.memory_usage_bytes,
                               grace_s=candidate.grace_s, forced=candidate.forced)
            if dry:
                self._audit.record("eviction_dry_run", pod=pod.ref, plugin=plugin,
                                   reason=candidate.reason)
                self._flights[pod.uid] = Flight(now, plugin, dry=True)
                outcome, throttled = Outcome.DRY_RUN, False
            else:
                outcome, throttled = await self._send(candidate, cfg, now)
            decisions.append(Decision(pod.ref, plugin, outcome))
            self._recent.append(Recent(now, pod.ref, plugin, outcome, candidate.reason))
            if self._metrics is not None:
                self._metrics.eviction(plugin, outcome.value)
            if throttled:
                # The server throttles this client, not the pod: the rest wait for next round.
                decisions += self._defer(chosen[index + 1:], Outcome.THROTTLED,
                                         self._throttled_why(self._now()))
                break
        return decisions

    def _throttled_why(self, now: float) -> str:
        """Why a throttled round's pods wait: until the server's Retry-After, or the next round."""
        wait = self._throttled_until - now
        return "the API server throttles evictions: " + (
            f"next try in {wait:.1f} s" if wait > 0 else "next round")

    def _defer(self, late: Sequence[Candidate], outcome: Outcome, why: str) -> list[Decision]:
        """The chosen pods left for a later round, audited once while they stay so."""
        for candidate in late:
            self._once.record("eviction_deferred", candidate.facts.pod.uid, outcome.value,
                              pod=candidate.facts.pod.ref, plugin=candidate.plugin, why=why)
        return [Decision(c.facts.pod.ref, c.plugin, outcome) for c in late]

    async def _send(self, candidate: Candidate, cfg: EvictionConfig,
                    now: float) -> tuple[Outcome, bool]:
        """The outcome, and whether the API server throttled the request."""
        pod, plugin = candidate.facts.pod, candidate.plugin
        bucket = self._bucket
        assert bucket is not None
        result = await self._actions.evict(pod.namespace, pod.name, candidate.grace_s, False,
                                           uid=pod.uid, reason=f"{plugin}: {candidate.reason}")
        outcome = result.outcome
        if outcome is EvictionOutcome.EVICTED:
            self._retries.done(pod.uid)
            self._flights[pod.uid] = Flight(now, plugin, dry=False)
            await self._actions.create_pod_event(
                PodRef(pod.namespace, pod.name, pod.uid), self._node, EVENT_REASON,
                f"Evicted by nri-qos, plugin {plugin}: {candidate.reason}")
            return Outcome.EVICTED, False
        if outcome is EvictionOutcome.GONE:
            bucket.give_back(now)
            self._flights[pod.uid] = Flight(now, plugin, dry=False)
            return Outcome.GONE, False
        if outcome is EvictionOutcome.UNAVAILABLE:
            bucket.give_back(now)
            if not self._told_unavailable:
                self._told_unavailable = True
                log.warning("eviction_unavailable",
                            detail="no Kubernetes API access: evictions are decided and "
                                   "audited, none can be made")
        elif result.refused:
            # A disruption budget, the API's throttling or a conflict said no: nothing was
            # disrupted, so the token is not spent.
            bucket.give_back(now)
        # The wait counts from the answer: the round's earlier requests took their time.
        answered = self._now()
        self._retries.refused(pod.uid, cfg, answered, result.retry_after_s)
        if result.throttled and result.retry_after_s is not None:
            # The server asked this client, not this pod, to wait: no eviction before then.
            self._throttled_until = max(self._throttled_until,
                                        answered + result.retry_after_s)
        return Outcome(outcome.value), result.throttled
