"""From the plugins' answers to the pods a round evicts: proposals resolved to pods, filtered
and audited (:func:`candidates`), then ranked and cut (:func:`choose`).

Pure of I/O: the manager passes in what it keeps between rounds (pods in flight, retry state,
the once-per-streak audit)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hooks.untrusted import bounded
from reconciler.eviction.api import (
    ActivePod,
    EvictionPlugin,
    EvictPods,
    MetType,
    ThresholdMet,
    TopPods,
)
from reconciler.eviction.choice import PodFacts, PodFilter, rank
from reconciler.eviction.config import EvictionConfig, grace_of
from reconciler.eviction.once import RoundAudit
from reconciler.eviction.retries import Retries

MAX_AUDITED_PROPOSALS = 64
"""Proposals of one plugin audited one by one per round (two records each at most): more than a
node's offline pods are rarely proposed at once, and a plugin listing thousands of uids must
not write thousands of records; the rest are counted in one ``eviction_proposals_capped``."""


@dataclass(frozen=True, slots=True)
class Candidate:
    facts: PodFacts
    plugin: str
    reason: str
    grace_s: int | None
    # Forced by its plugin, or the target of a hard-met plugin: evicted before soft candidates.
    forced: bool


@dataclass(slots=True)
class Flight:
    """A pod whose eviction was accepted, found gone, or dry-run: not asked again."""

    at: float
    plugin: str
    dry: bool


@dataclass(slots=True)
class Answers:
    """What each plugin answered this round, by plugin name (a plugin that failed is absent)."""

    threshold: dict[str, ThresholdMet] = field(default_factory=dict)
    evict: dict[str, EvictPods] = field(default_factory=dict)
    top: dict[str, TopPods] = field(default_factory=dict)

    def none_met(self, plugins: Sequence[str]) -> bool:
        """Every one of ``plugins`` answered both calls, and none met its threshold."""
        return all(name in self.threshold and self.threshold[name].met is MetType.NOT_MET
                   and name in self.evict for name in plugins)


def candidates(plugins: Sequence[EvictionPlugin],
               hard: Sequence[tuple[EvictionPlugin, ThresholdMet]], answers: Answers,
               facts: Mapping[str, PodFacts], cfg: EvictionConfig, flights: Mapping[str, Flight],
               pod_filter: PodFilter, once: RoundAudit, *,
               need_description: bool) -> list[Candidate]:
    """Every proposal of the round, resolved to a pod, audited, and filtered; one per pod
    (a forced proposal wins over a soft one, then the first plugin)."""
    proposals: list[tuple[str, str, str, int | None, bool]] = []
    for source, threshold in hard:
        top = answers.top.get(source.name)
        if top is not None:
            reason = f"threshold hard-met: {threshold.describe()}"
            proposals += [(uid, source.name, reason, top.grace_s, True) for uid in top.uids]
    for source in plugins:
        wanted = answers.evict.get(source.name)
        if wanted is not None:
            proposals += [(req.uid, source.name, req.reason, req.grace_s, req.force)
                          for req in wanted.pods]
    chosen: dict[str, Candidate] = {}
    # Proposals audited one by one per plugin this round; the rest are counted.
    audited: dict[str, int] = {}
    for uid, plugin, reason, grace, forced in proposals:
        found = facts.get(uid)
        pod = found.pod.ref if found is not None else f"uid {bounded(uid)}"
        loud = audited.get(plugin, 0) < MAX_AUDITED_PROPOSALS
        audited[plugin] = audited.get(plugin, 0) + 1
        if loud:
            once.record("eviction_candidate", uid, plugin, pod=pod, plugin=plugin,
                        reason=reason, force=forced)
        flight = flights.get(uid)
        if found is None:
            why: str | None = "not a running pod of this node"
        elif flight is not None:
            why = "already being evicted" + (" (dry-run)" if flight.dry else "")
        else:
            why = pod_filter.why_not(found, need_description=need_description) \
                or _not_sooner(found, grace if grace is not None else grace_of(cfg.grace_period_s))
        if why is not None:
            if loud:
                once.record("eviction_filtered", uid, plugin, why, pod=pod, plugin=plugin,
                            why=why)
            continue
        assert found is not None
        earlier = chosen.get(uid)
        if earlier is None or (forced and not earlier.forced):
            grace = grace if grace is not None else grace_of(cfg.grace_period_s)
            chosen[uid] = Candidate(found, plugin, reason, grace, forced)
    for plugin, count in audited.items():
        if count > MAX_AUDITED_PROPOSALS:
            once.record("eviction_proposals_capped", plugin, plugin=plugin, proposals=count,
                        audited=MAX_AUDITED_PROPOSALS, omitted=count - MAX_AUDITED_PROPOSALS)
    return list(chosen.values())


def _not_sooner(facts: PodFacts, grace: int | None) -> str | None:
    """Why evicting a pod already being deleted with a long grace would change nothing: an
    eviction asking for its own grace (None), or a grace as long, does not end it sooner, and
    would only spend a token and tell its owners it was evicted."""
    if facts.lingering_s is None or (grace is not None and grace < facts.lingering_s):
        return None
    asked = "its own grace" if grace is None else f"a grace of {grace} s"
    return (f"terminating with a grace of {facts.lingering_s} s: an eviction with {asked} "
            "would not end it sooner")


def choose(candidates: Sequence[Candidate], retries: Retries, once: RoundAudit,
           cfg: EvictionConfig, now: float) -> list[Candidate]:
    """Forced and hard-met targets ranked, then the best ``soft_per_round`` soft ones; pods
    backing off after a refusal wait."""
    ready = []
    for candidate in candidates:
        retry = retries.waiting(candidate.facts.pod.uid, now)
        if retry is not None:
            once.record("eviction_deferred", candidate.facts.pod.uid, "backoff",
                        pod=candidate.facts.pod.ref, plugin=candidate.plugin,
                        why=f"backing off after {retry.backoff.failures} refused or failed "
                            f"eviction(s); next try in {retry.at - now:.1f} s")
            continue
        ready.append(candidate)

    def pod_of(candidate: Candidate) -> ActivePod:
        return candidate.facts.pod

    forced = rank([c for c in ready if c.forced], pod_of, cfg.sort_keys)
    soft = rank([c for c in ready if not c.forced], pod_of, cfg.sort_keys)
    return forced + soft[:cfg.soft_per_round]


def is_dry(plugin: str, cfg: EvictionConfig) -> bool:
    return cfg.dry_run or plugin in cfg.dry_run_plugins


def forget_left(flights: dict[str, Flight], retries: Retries,
                facts: Mapping[str, PodFacts], cfg: EvictionConfig, now: float) -> None:
    """Forget evictions of pods that left (or long ago), dry-run ones whose plugin is no
    longer dry, and retry state of pods that left."""
    for uid, flight in list(flights.items()):
        if uid not in facts or now - flight.at >= cfg.reevict_after_s \
                or (flight.dry and not is_dry(flight.plugin, cfg)):
            del flights[uid]
    retries.keep_only(facts)
