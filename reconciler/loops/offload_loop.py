"""The offloading loop: each cycle reads every eligible container's counters, asks the pure
controller of :mod:`reconciler.loops.offload` for its step, shares the node's budget among
the steps and writes them to ``memory.reclaim`` from a child process (see that module's doc
for the formula and the limits)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from common.audit import AuditLog
from common.state import NodeState
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.held_writes import HeldWrites
from reconciler.host.numa import MEMINFO, meminfo_values
from reconciler.host.parse import ParseError, errno_text
from reconciler.host.parse import parse_counters as counter_values
from reconciler.host.probe import HostInfo
from reconciler.host.sysfs import Outcome, SysFs, short_reclaim
from reconciler.host.values import PAGE_SIZE, parse_bytes
from reconciler.loops.base import Loop
from reconciler.loops.common import Managed, ManagedCache
from reconciler.loops.offload import (
    MIN_PERCENT,
    Counters,
    Decision,
    OffloadConfig,
    OffloadSections,
    Track,
    anon_allowed,
    budget,
    decide,
    eligible,
    offload_problem,
    parse_counters,
    share,
)
from reconciler.metrics import ReconcilerMetrics

log = structlog.get_logger("nri_qos.reconciler")

WRITER_NICE = 19
"""The niceness of the process that writes memory.reclaim, in whose context the kernel does the
reclaim: background work that must yield the CPU to the pods the node is for (measured in
``docs/offloading.md``)."""

def swap_room(sysfs: SysFs, layout: CgroupLayout, rel: str) -> bool:
    """Whether the cgroup ``rel`` and every cgroup above it (the root has no limit) have room
    under their ``memory.swap.max``: the kernel charges swap to all of them and swaps a
    cgroup's anonymous memory out only while each has some left, so a pod or tier at ``0``
    (or full) shuts out a container of ``max``. A limit that does not read as a size counts
    as none."""
    parts = rel.split("/")
    for depth in range(len(parts), 0, -1):
        cgroup = layout.dir("memory", "/".join(parts[:depth]))
        limit_text = sysfs.read(f"{cgroup}/memory.swap.max")
        if limit_text is None:
            continue
        try:
            limit = parse_bytes(limit_text)
            used = parse_bytes(sysfs.read(f"{cgroup}/memory.swap.current") or "0")
        except ValueError:
            continue
        if limit is not None and (used or 0) >= limit:
            return False
    return True


@dataclass(frozen=True, slots=True)
class PodOffload:
    """A pod's offloading so far, for the metrics."""

    pod_uid: str
    offloaded_bytes: int  # reclaimed by the loop's steps, in total
    stall_us: int  # memory stall of its containers during cycles that followed a step
    refaults_per_s: float  # its containers' refault rate at their last cycle


class OffloadLoop(Loop):
    name = "offload"

    def __init__(self, config: Callable[[], OffloadSections], state: NodeState, sysfs: SysFs,
                 host: HostInfo, audit: AuditLog, *,
                 ladder_engaged: Callable[[], bool] = lambda: False,
                 managed: ManagedCache | None = None,
                 metrics: ReconcilerMetrics | None = None) -> None:
        self._config = config
        self._state = state
        self._sysfs = sysfs
        self._layout: CgroupLayout = host.cgroup
        self._audit = audit
        self._ladder_engaged = ladder_engaged
        self._managed = ManagedCache() if managed is None else managed
        self.problem = offload_problem(host)
        # container id -> its controller state
        self._tracks: dict[str, Track] = {}
        self._last_cycle: float | None = None
        self._paused = False
        # pod uid -> (bytes offloaded, stall µs after steps) so far
        self._pods: dict[str, tuple[int, int]] = {}
        # container id -> (pod uid, refaults per second at its last cycle)
        self._rates: dict[str, tuple[str, float]] = {}
        self._pods_lock = threading.Lock()
        self._unreadable = HeldWrites()  # container cgroup -> why its files were not read
        if metrics is not None:
            metrics.watch_offload(self.pods, self._pod_names)

    def interval(self) -> float:
        return self._config().offload.interval_s

    def pods(self) -> list[PodOffload]:
        """Every pod's offloading so far (safe from any thread)."""
        with self._pods_lock:
            rates: dict[str, float] = {}
            for uid, rate in self._rates.values():
                rates[uid] = rates.get(uid, 0.0) + rate
            return [PodOffload(uid, offloaded, stall, rates.get(uid, 0.0))
                    for uid, (offloaded, stall) in self._pods.items()]

    def _pod_names(self) -> dict[str, tuple[str, str]]:
        return {view.info.uid: (view.info.namespace, view.info.name)
                for view in self._state.snapshot().pods.values()}

    def cycle(self, now: float) -> None:
        cfg = self._config()
        off = cfg.offload
        since_last = None if self._last_cycle is None else now - self._last_cycle
        self._last_cycle = now
        if not (cfg.reconciler.enabled and off.enabled) or self.problem:
            self._tracks.clear()
            self._forget((), ())
            return
        if self._ladder_engaged():
            if not self._paused:
                self._paused = True
                self._audit.record("offload_paused", reason="the mitigation ladder is engaged")
            # Counters read across the ladder's actions would blame them on the steps.
            self._tracks.clear()
            return
        if self._paused:
            self._paused = False
            self._audit.record("offload_resumed", reason="the mitigation ladder is released")
        swap = meminfo_values(self._sysfs.read(MEMINFO)).get("SwapTotal", 0)
        items = [m for m in self._managed.get(self._state.snapshot())
                 if eligible(m.level, m.view.pod.info.annotations, off)]
        decided: dict[str, tuple[Managed, Decision, Counters, bool]] = {}
        for item in items:
            found = self._decide(item, off, now, swap)
            if found is not None:
                decided[item.view.info.id] = (item, *found)
        live = set(decided)
        for gone in [c for c in self._tracks if c not in live]:
            del self._tracks[gone]
        self._forget({m.view.pod.info.uid for m in items}, live)
        grants = share([(cid, d.ask) for cid, (_, d, _, _) in decided.items()],
                       budget(off, since_last))
        for cid, (item, decision, counters, anon) in decided.items():
            grant = grants.get(cid, 0)
            reclaimed: int | None = None
            percent = decision.percent
            if grant and not self._ladder_engaged():
                reclaimed, timed_out = self._step(item, decision, grant, anon, off)
                if timed_out:
                    # The kernel worked for the whole deadline: the memory is not that cold.
                    percent = max(percent / 2, MIN_PERCENT)
            self._tracks[cid] = Track(now, counters, percent,
                                      0 if reclaimed is None else grant, reclaimed or 0)

    def _decide(self, item: Managed, off: OffloadConfig, now: float, swap: int
                ) -> tuple[Decision, Counters, bool] | None:
        cgroup = self._layout.dir("memory", item.ref.rel)
        try:
            stat = self._sysfs.read(f"{cgroup}/memory.stat")
            pressure = self._sysfs.read(f"{cgroup}/memory.pressure")
            if stat is None or pressure is None:
                return None
            counters = parse_counters(stat, pressure)
        except (OSError, ParseError) as exc:
            # That container's alone, said once while it lasts: the others are still decided.
            error = str(exc) if isinstance(exc, ParseError) else errno_text(exc)
            if self._unreadable.news(cgroup, error):
                log.warning("offload_unreadable", container=item.view.info.name, error=error)
            return None
        self._unreadable.forget(cgroup)
        anon = (anon_allowed(off, swap, self._sysfs.read(f"{cgroup}/memory.swap.max"))
                and swap_room(self._sysfs, self._layout, item.ref.rel))
        previous = self._tracks.get(item.view.info.id)
        decision = decide(off, previous, now, counters, anon)
        if previous is not None:
            uid = item.view.pod.info.uid
            self._account(uid, 0,
                          counters.stall_us - previous.counters.stall_us if previous.asked else 0)
            with self._pods_lock:
                self._rates[item.view.info.id] = (uid, decision.refaults_per_s)
        return decision, counters, anon

    def _step(self, item: Managed, decision: Decision, grant: int, anon: bool,
              off: OffloadConfig) -> tuple[int | None, bool]:
        """One write to the container's memory.reclaim: the bytes the kernel reclaimed (None:
        the step was not taken: dry run, observe mode, the cgroup gone), and whether the writer
        was killed at the deadline."""
        cgroup = self._layout.dir("memory", item.ref.rel)
        path = f"{cgroup}/memory.reclaim"
        pod = item.view.pod.info
        fields: dict[str, object] = dict(
            path=path, pod_uid=pod.uid, container=item.view.info.name, asked_bytes=grant,
            wanted_bytes=decision.ask, percent=round(decision.percent, 3),
            verdict=decision.verdict, base_bytes=decision.base, anon=anon,
            stall_us_per_s=round(decision.stall_us_per_s, 1),
            refault_ratio=None if decision.refault_ratio is None
            else round(decision.refault_ratio, 4))
        if off.dry_run:
            self._audit.record("offload_step", result="dry_run", dry_run=True, **fields)
            return None, False
        before = self._sysfs.read(f"{cgroup}/memory.stat")
        started = time.monotonic()
        outcome, error = self._sysfs.write_bounded(path, str(grant), off.step_timeout_s,
                                                   nice=WRITER_NICE)
        duration = round(time.monotonic() - started, 6)
        after = self._sysfs.read(f"{cgroup}/memory.stat")
        freed = _freed(before, after)
        result = {Outcome.WRITTEN: "done", Outcome.TIMEOUT: "timeout",
                  Outcome.GONE: "gone", Outcome.OBSERVED: "observed"}.get(outcome, "failed")
        if short_reclaim(outcome, error):
            result = "short"
        self._audit.record("offload_step", result=result, dry_run=False, duration_s=duration,
                           reclaimed_bytes=freed.get("pgsteal"),
                           file_freed_bytes=freed.get("file"),
                           anon_freed_bytes=freed.get("anon"), error=error or None, **fields)
        if outcome in (Outcome.OBSERVED, Outcome.GONE):
            return None, False
        reclaimed = freed.get("pgsteal", 0)
        self._account(pod.uid, reclaimed, 0)
        return reclaimed, outcome is Outcome.TIMEOUT

    def _account(self, uid: str, offloaded: int, stall_us: int) -> None:
        with self._pods_lock:
            had_bytes, had_stall = self._pods.get(uid, (0, 0))
            self._pods[uid] = (had_bytes + offloaded, had_stall + max(stall_us, 0))

    def _forget(self, pods: Iterable[str], containers: Iterable[str]) -> None:
        """Pods and containers no longer offloaded leave the metrics."""
        keep_pods, keep_containers = set(pods), set(containers)
        with self._pods_lock:
            for uid in [u for u in self._pods if u not in keep_pods]:
                del self._pods[uid]
            for cid in [c for c in self._rates if c not in keep_containers]:
                del self._rates[cid]


def _freed(before: str | None, after: str | None) -> dict[str, int]:
    """What went between two readings of ``memory.stat``: ``pgsteal`` (pages reclaimed, as
    bytes), ``file`` and ``anon`` (bytes less; growth counts as 0)."""
    if before is None or after is None:
        return {}
    try:
        old, new = counter_values(before), counter_values(after)
    except ParseError:
        return {}
    found: dict[str, int] = {}
    for key in ("pgsteal", "file", "anon"):
        if key in old and key in new:
            change = new[key] - old[key] if key == "pgsteal" else old[key] - new[key]
            found[key] = max(change, 0) * (PAGE_SIZE if key == "pgsteal" else 1)
    return found
