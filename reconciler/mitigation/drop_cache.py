"""Drop the page cache of reclaimed pods, largest cache first, off the event loop.

v2 writes an amount to the pod cgroup's ``memory.reclaim`` (the pod's cache, at most
``reclaim_bytes``); v1 writes ``0`` to ``memory.force_empty`` (everything reclaimable). These
writes block in the kernel while it reclaims, so each runs in a child process, killed after
``timeout_s`` (a killed writer ends the kernel's work; a thread could only be abandoned), or when
the agent stops (a writer also dies with the agent: it asks the kernel for that when it starts),
from a pool of ``workers`` threads; a pod has at most one drop at a time. Only
``reclaimed_cores`` pods are ever touched, checked when the plan is made and again right before
the write. Each drop is audited when it starts and when it ends, with its duration and the pod's
usage before and after.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from common.audit import AuditLog
from hooks.levels import QosLevel
from reconciler.detection.pods import PodIndex, PodMemory
from reconciler.host.parse import ParseError, errno_text, parse_counters
from reconciler.host.probe import HostInfo
from reconciler.host.sysfs import Outcome, SysFs, short_reclaim
from reconciler.metrics import ReconcilerMetrics
from reconciler.mitigation.actions import (
    DONE,
    DRY_RUN,
    FAILED,
    SKIPPED,
    TIMEOUT,
    UNCHANGED,
    Cause,
    MitigationSections,
    Result,
)
from reconciler.mitigation.config import DropCacheRung

log = structlog.get_logger("nri_qos.mitigation")

SHORT = "short"
"""A drop the kernel made less than asked: cgroup v2's ``memory.reclaim`` answers EAGAIN when it
reclaimed less than the amount written (the pod's page cache is shared memory, which cannot go
without swap, or it refilled meanwhile). What could go went, so the ladder counts it as done
rather than try again at once; its record says ``short`` and what was freed."""


def drop_file(host: HostInfo) -> str:
    return "memory.reclaim" if host.cgroup.v2 else "memory.force_empty"


def drop_cache_problem(host: HostInfo) -> str:
    """"" when this host's memcg can drop a pod's cache, else why not."""
    has = host.memcg.reclaim if host.cgroup.v2 else host.memcg.force_empty
    if has:
        return ""
    return f"the kernel has no {drop_file(host)}" + (" (Linux 5.19+)" if host.cgroup.v2 else "")


@dataclass(frozen=True, slots=True)
class Candidate:
    pod: PodMemory
    cache_bytes: int


def page_cache(stat: str, v2: bool) -> int:
    """A pod's page cache from its cgroup's memory.stat (v2 ``file``, v1 ``total_cache``, the
    hierarchical figure of a pod's cgroup, else ``cache``). Raises ParseError."""
    values = parse_counters(stat)
    for name in (("file",) if v2 else ("total_cache", "cache")):
        if name in values:
            return values[name]
    raise ParseError(f"memory.stat lacks {'file' if v2 else 'total_cache'}")


def plan(candidates: Sequence[Candidate], rung: DropCacheRung,
         busy: frozenset[str] = frozenset()) -> list[Candidate]:
    """Reclaimed pods with at least ``min_cache_bytes`` of cache and no drop running, largest
    cache first, at most ``max_pods``."""
    chosen = [c for c in candidates if c.pod.level == QosLevel.RECLAIMED_CORES
              and c.cache_bytes >= rung.min_cache_bytes and c.pod.uid not in busy]
    chosen.sort(key=lambda c: (-c.cache_bytes, c.pod.uid))
    return chosen[:rung.max_pods]


@dataclass(frozen=True, slots=True)
class Drop:
    pod_uid: str
    result: str
    freed_bytes: int
    detail: str = ""


class DropCacheAction:
    def __init__(self, config: Callable[[], MitigationSections], sysfs: SysFs, host: HostInfo,
                 pods: PodIndex, audit: AuditLog, *,
                 clock: Callable[[], float] = time.monotonic,
                 metrics: ReconcilerMetrics | None = None) -> None:
        self._config = config
        self._metrics = metrics
        self._sysfs = sysfs
        self._pods = pods
        self._audit = audit
        self._clock = clock
        self._v2 = host.cgroup.v2
        self._file = drop_file(host)
        self.problem = drop_cache_problem(host)
        if self.problem:
            log.info("drop_cache_unavailable", reason=self.problem)
        self._pool = ThreadPoolExecutor(max_workers=config().mitigation.drop_cache.workers,
                                        thread_name_prefix="nri-qos-drop-cache")
        self._lock = threading.Lock()
        self._busy: set[str] = set()
        # Pods whose cache this engagement dropped: the ladder's retry of a failed round then
        # drops only what failed, not the others' cache again long before repeat_s.
        self._dropped: set[str] = set()

    def close(self) -> None:
        """The agent stops: running drops are killed (their writers die, the kernel stops
        reclaiming), not waited for; queued ones never start."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        killed = self._sysfs.kill_writers()
        if killed:
            log.info("drop_cache_stopped", killed=killed)

    def busy(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._busy)

    def candidates(self) -> list[Candidate]:
        """Reclaimed pods with their page cache (pods whose memory.stat is unreadable are
        left out)."""
        found = []
        for pod in self._pods.pods():
            if pod.level != QosLevel.RECLAIMED_CORES:
                continue
            try:
                stat = self._sysfs.read(f"{pod.cgroup}/memory.stat")
            except OSError as exc:  # that pod's alone: the others' cache is still dropped
                log.warning("drop_cache_stat_unreadable", pod=pod.name,
                            reason=f"memory.stat unreadable: {errno_text(exc)}")
                continue
            try:
                cache = page_cache(stat, self._v2) if stat is not None else None
            except ParseError as exc:
                log.warning("drop_cache_stat_unreadable", pod=pod.name, reason=str(exc))
                continue
            if cache is not None:
                found.append(Candidate(pod, cache))
        return found

    async def engage(self, cause: Cause, dry_run: bool) -> Result:
        if self.problem:
            return Result(SKIPPED, self.problem)
        rung = self._config().mitigation.drop_cache
        found = await asyncio.to_thread(self.candidates)
        # A failed round is engaged again, never repeated, for as long as the level holds:
        # the pods dropped meanwhile that went since are not kept for that long.
        self._dropped &= {pod.uid for pod in self._pods.pods()}
        chosen = plan(found, rung, self.busy() | self._dropped)
        if not chosen:
            return Result(UNCHANGED, f"no reclaimed pod with {rung.min_cache_bytes} B of page "
                                     "cache or more (not dropped already by this engagement, "
                                     "no drop running)")
        names = ", ".join(f"{c.pod.name} ({c.cache_bytes} B)" for c in chosen)
        if dry_run:
            return Result(DRY_RUN, f"would drop the cache of {names}")
        with self._lock:
            self._busy.update(c.pod.uid for c in chosen)
        loop = asyncio.get_running_loop()
        reason = cause.text()
        drops = await asyncio.gather(*(loop.run_in_executor(self._pool, self.drop, c, rung,
                                                            reason) for c in chosen))
        self._dropped.update(x.pod_uid for x in drops if x.result in (DONE, SHORT))
        freed = sum(max(x.freed_bytes, 0) for x in drops)
        results = {x.result for x in drops}
        summary = f"{len(drops)} pod(s), {freed} B freed"
        # A pod skipped at its write (gone meanwhile, or no longer reclaimed) had nothing to
        # drop: not a failure, or the ladder would retry the round after its backoff and drop
        # the other pods' cache again long before repeat_s.
        if results <= {DONE, SHORT, SKIPPED}:
            short = sum(x.result == SHORT for x in drops)
            skipped = sum(x.result == SKIPPED for x in drops)
            notes = [*([f"{short} short of the amount asked"] if short else []),
                     *([f"{skipped} skipped (gone or no longer reclaimed)"] if skipped else [])]
            return Result(DONE, "; ".join([summary, *notes]))
        failed = "; ".join(f"{x.pod_uid}: {x.result} {x.detail}" for x in drops
                           if x.result not in (DONE, SHORT, SKIPPED))
        return Result(TIMEOUT if TIMEOUT in results and len(results) == 1 else FAILED,
                      f"{summary}; {failed}")

    async def repeat(self, cause: Cause, dry_run: bool) -> Result:
        self._dropped.clear()  # repeat_s has passed: every pod's cache may go again
        return await self.engage(cause, dry_run)

    async def release(self, cause: Cause, dry_run: bool) -> Result:
        self._dropped.clear()
        return Result(UNCHANGED, "nothing to undo: caches refill by themselves")

    def drop(self, candidate: Candidate, rung: DropCacheRung, reason: str) -> Drop:
        """One pod's drop, in a pool thread; audited at start and end."""
        pod = candidate.pod
        try:
            if pod.level != QosLevel.RECLAIMED_CORES:  # never an online pod, whatever the plan
                return Drop(pod.uid, SKIPPED, 0, f"level {pod.level}")
            path = f"{pod.cgroup}/{self._file}"
            value = str(min(candidate.cache_bytes, rung.reclaim_bytes)) if self._v2 else "0"
            usage_file = f"{pod.cgroup}/{'memory.current' if self._v2 else 'memory.usage_in_bytes'}"
            before = self._sysfs.read_int(usage_file)
            self._audit.record("drop_cache_started", path=path, reason=reason, pod_uid=pod.uid,
                               pod=pod.name, cache_bytes=candidate.cache_bytes, value=value,
                               usage_before_bytes=before)
            started = self._clock()
            outcome, error = self._sysfs.write_bounded(path, value, rung.timeout_s)
            duration = round(self._clock() - started, 6)
            after = self._sysfs.read_int(usage_file)
            freed = before - after if before is not None and after is not None else 0
            result = {Outcome.WRITTEN: DONE, Outcome.TIMEOUT: TIMEOUT}.get(outcome, FAILED)
            if outcome is Outcome.GONE:
                result = SKIPPED
            elif self._v2 and short_reclaim(outcome, error):
                result = SHORT
            self._audit.record("drop_cache_finished", path=path, duration_s=duration,
                               result=result, pod_uid=pod.uid, usage_before_bytes=before,
                               usage_after_bytes=after, freed_bytes=freed, error=error or None)
            if self._metrics is not None:
                self._metrics.drop_cache(result, freed)
            return Drop(pod.uid, result, freed, error)
        finally:
            with self._lock:
                self._busy.discard(pod.uid)
