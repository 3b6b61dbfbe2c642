"""When a pod whose eviction was refused (429), failed or could not be asked for is tried again.

Each such pod backs off on its own: ``retry_initial_s`` after the first refusal, doubling up to
``retry_max_s``. An answer that says when to come back (``Retry-After``, bounded by
:data:`~reconciler.kube.evictions.MAX_RETRY_AFTER_S`) holds the pod at least that long: an
earlier try would only be refused again, and costs the API server the request it asked to be
spared. Time is passed in, from the manager's clock.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from common.aio import Backoff
from reconciler.eviction.config import EvictionConfig


@dataclass(slots=True)
class Retry:
    at: float
    backoff: Backoff


class Retries:
    """The pods (by uid) waiting to be tried again."""

    def __init__(self) -> None:
        self._waiting: dict[str, Retry] = {}

    def any_waiting(self, now: float) -> bool:
        """Some pod must still wait before its next try. One whose wait is over is left out:
        it is tried again only if a plugin proposes it again, and such a proposal keeps the
        rounds going on its own."""
        return any(now < retry.at for retry in self._waiting.values())

    def waiting(self, uid: str, now: float) -> Retry | None:
        """The pod's backoff while it must still wait, else None."""
        retry = self._waiting.get(uid)
        return retry if retry is not None and now < retry.at else None

    def refused(self, uid: str, cfg: EvictionConfig, now: float,
                retry_after_s: float | None = None) -> None:
        """One more refusal or failure, answered at ``now``: the next try after the pod's
        next backoff, and not before ``retry_after_s``, both counted from the answer."""
        retry = self._waiting.get(uid)
        if retry is None:
            retry = self._waiting[uid] = Retry(now, Backoff(cfg.retry_initial_s, cfg.retry_max_s))
        retry.at = now + max(retry.backoff.next(), retry_after_s or 0.0)

    def done(self, uid: str) -> None:
        """The pod was evicted: its backoff is over."""
        self._waiting.pop(uid, None)

    def keep_only(self, uids: Container[str]) -> None:
        """Forget the pods that left."""
        for uid in [uid for uid in self._waiting if uid not in uids]:
            del self._waiting[uid]
