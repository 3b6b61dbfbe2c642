"""Whether a pod's claimed DaemonSet owner exists: a pod's author can write any owner
reference, so a pod is spared as a DaemonSet's only once the API server has the DaemonSet."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from reconciler.eviction.api import ActivePod
from reconciler.eviction.choice import PodFacts
from reconciler.kube import KubeActions

OWNER_CHECK_TTL_S = 300.0
"""How long the API's answer about a pod's DaemonSet owner is kept: owners come and go far less
often than rounds run (one a second under pressure)."""


class OwnerCheck:
    """The API's answers about DaemonSet owners, kept for :data:`OWNER_CHECK_TTL_S`."""

    def __init__(self, actions: KubeActions) -> None:
        self._actions = actions
        # (namespace, DaemonSet name, uid) -> (whether it exists, when the API said so)
        self._owners: dict[tuple[str, str, str], tuple[bool, float]] = {}

    async def confirm(self, facts: dict[str, PodFacts], proposed: set[str],
                      now: float) -> dict[str, PodFacts]:
        """Proposed pods naming an apps/v1 DaemonSet as controller, with whether the API has
        it. A failed check leaves the pod unconfirmed (not evicted)."""
        for key in [k for k, (_, at) in self._owners.items() if now - at >= OWNER_CHECK_TTL_S]:
            del self._owners[key]
        for uid in proposed:
            found = facts.get(uid)
            owner = found.claimed_daemonset if found is not None else None
            if found is None or owner is None:
                continue
            key = (found.pod.namespace, owner.name, owner.uid)
            known = self._owners.get(key)
            exists = known[0] if known is not None else \
                await self._actions.owner_exists(found.pod.namespace, owner)
            if exists is not None and known is None:
                self._owners[key] = (exists, now)
            facts[uid] = dataclasses.replace(found, daemonset=exists)
        return facts

    async def evictable(self, active: Sequence[ActivePod], facts: dict[str, PodFacts],
                        refused: Callable[[PodFacts], str | None],
                        now: float) -> list[ActivePod]:
        """The pods of ``active`` that ``refused`` (the filter) lets go, the only ones offered
        for a hard-met plugin's top: a protected pod ranked first (a BestEffort DaemonSet's,
        say) would be named and refused every round, and no other pod would ever go. Only the
        owners of pods no other rule refuses are asked of the API; ``facts`` then carry the
        answers."""

        def passing(pods: Sequence[ActivePod]) -> list[ActivePod]:
            return [pod for pod in pods if refused(facts[pod.uid]) is None]

        # An owner not asked about yet counts as no DaemonSet in the first pass.
        maybe = passing(active)
        await self.confirm(facts, {pod.uid for pod in maybe}, now)
        return passing(maybe)
