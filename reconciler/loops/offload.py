"""Offloading: proactive reclaim of the memory offline containers hold but do not use (cgroup v2).

Cold memory (file cache read once, anonymous memory touched once) that an offline container keeps
is memory the offline tier cannot use and the node's reclaim must find under pressure, when online
pods pay for it. This loop asks the kernel, through each container's ``memory.reclaim``, to take
a little of it back at every cycle, and watches what that costs the container itself.

Which containers: every container of a ``reclaimed_cores`` pod; of a ``shared_cores`` pod only
when ``offload.shared_cores`` is true *and* the pod is annotated ``offload.annotation = "true"``
(both: the node allows it, the pod asks for it). Never any other level.

Per container, from the deltas of its own files over the time ``t`` since its last cycle
(``memory.pressure``'s ``some total=`` in µs; ``memory.stat``'s ``pgscan``, ``pgsteal``,
``workingset_refault_anon`` + ``workingset_refault_file``)::

    stall     = Δsome_total / t                             (µs of stall per second)
    refault   = Δrefault / Δpgsteal                         (1 - reclaim accuracy)
    scan      = Δpgsteal / Δpgscan                          (scan efficiency; 1 without a scan)
    base      = inactive_file (+ inactive_anon where anonymous memory may go, below)
    ask       = min(percent / 100 x base, max_step_bytes, the budget left), whole pages

``percent`` starts at ``initial_percent``; after a step:

* ``stall > max_stall_percent / 100 x 1 s``: no step this cycle, ``percent`` halves (the
  container waits for memory: it is not cold);
* ``refault > 1 - min_accuracy_percent / 100`` (refaults with nothing reclaimed count as
  inaccurate): no step, ``percent`` halves (what was taken comes back);
* ``scan < min_efficiency_percent / 100``: a step at half the ``percent`` (the kernel works hard
  for what it finds);
* otherwise ``percent`` grows by ``fast_grow_percent`` when the last step got all it asked with no
  refault at all, else by ``grow_percent``; never above ``max_step_percent``.

A step killed at its deadline halves ``percent`` too. ``percent`` never falls below
:data:`MIN_PERCENT`; a step under ``min_step_bytes`` is not taken.
A container's first cycle only reads its counters. The stall counter's increase per interval, not
the kernel's 60 s average, drives the back-off, so the loop reacts at its next cycle.

Across all containers, a cycle asks at most ``max_bytes_per_s x min(t, interval_s)`` bytes
(``t``: since the loop's last cycle), largest asks first: reclaim is CPU and I/O work that must
not become the node's load.

Anonymous memory: only where ``offload.anon`` is true, the node has swap (zswap included: it
needs a swap device too) and the container's ``memory.swap.max`` is not ``0``; otherwise the base
is the inactive file memory only, since without swap the kernel cannot reclaim anonymous memory.
``memory.reclaim`` of Linux 6.1 takes no ``swappiness=``: with swap on and anonymous offloading
not allowed, the kernel may still take some anonymous memory, by the node's swappiness; the steps
stay bounded by the inactive file memory, each step's audit record says how much anonymous
memory went, and ``nri-qos probe`` says so.

Never while the mitigation ladder is engaged (the ladder owns the node then; the containers'
baselines start over afterwards). Each write runs in a child process killed after
``step_timeout_s`` (:meth:`SysFs.write_bounded`) at niceness 19 (the kernel reclaims in the
writer's context: background work yields to the pods), and goes through the agent's SysFs, so
observe mode holds it; ``dry_run`` decides and audits without writing. Every step is audited
(``offload_step``) with what was asked and what the kernel reclaimed. Nothing is restored when
offloading stops: reclaimed memory comes back by itself when it is used.

cgroup v1 has no ``memory.reclaim``: the loop idles there, and ``probe`` and ``status`` say why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from common.audit import AuditLog
from common.state import NodeState
from hooks.config_fields import setting
from hooks.levels import QosLevel
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.numa import MEMINFO, meminfo_values
from reconciler.host.probe import HostInfo
from reconciler.host.sysfs import PAGE_SIZE, Outcome, SysFs
from reconciler.loops.base import Loop, ReconcilerConfig
from reconciler.loops.common import Managed, ManagedCache
from reconciler.metrics import ReconcilerMetrics

log = structlog.get_logger("nri_qos.reconciler")

WRITER_NICE = 19
"""The niceness of the process that writes memory.reclaim, in whose context the kernel does the
reclaim: background work that must yield the CPU to the pods the node is for (measured in
``docs/offloading.md``)."""

MIN_PERCENT = 1.0
"""``percent`` is never halved below this: a container that backed off still probes with small
steps, so memory that turned cold later is found."""


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    enabled: bool = setting(
        False, "Reclaim, proactively, memory that offline containers hold but do not use "
        "(cgroup v2, memory.reclaim). Off by default: proactive reclaim moves memory out from "
        "under running jobs, and a node should turn it on after a look at the audit trail "
        "of dry_run.")
    dry_run: bool = setting(False, "Decide and audit every step, write nothing.")
    interval_s: float = setting(5.0, "Period of the offloading loop.", unit="seconds",
                                minimum=0.5, maximum=3600)
    shared_cores: bool = setting(
        False, "Offload shared_cores containers too, those of pods annotated with "
        "annotation = \"true\" (both are needed; reclaimed_cores containers need neither).")
    annotation: str = setting("nri-qos.io/offload",
                              "Pod annotation that opts a shared_cores pod in (value \"true\").")
    anon: bool = setting(
        False, "Offload anonymous memory too, where the node has swap (or zswap) and the "
        "container's memory.swap.max is not 0; else file cache only.")
    initial_percent: float = setting(
        5.0, "A container's first step: this share of its inactive memory.", unit="percent",
        minimum=MIN_PERCENT, maximum=100)
    grow_percent: float = setting(
        5.0, "Each step grows by this share of the inactive memory while reclaim accuracy and "
        "scan efficiency hold.", unit="percent", minimum=0, maximum=100)
    fast_grow_percent: float = setting(
        10.0, "... by this share when, besides, the last step got all it asked with no "
        "refault at all.", unit="percent", minimum=0, maximum=100)
    max_step_percent: float = setting(
        50.0, "A step never asks more than this share of the inactive memory.", unit="percent",
        minimum=MIN_PERCENT, maximum=100)
    max_step_bytes: int = setting(256 << 20, "Largest step of one container.", unit="bytes",
                                  minimum=PAGE_SIZE, maximum=1 << 50)
    min_step_bytes: int = setting(1 << 20, "Smaller steps are not taken.", unit="bytes",
                                  minimum=PAGE_SIZE, maximum=1 << 40)
    max_stall_percent: float = setting(
        0.5, "Back off when the container's memory stall (memory.pressure some) grew by more "
        "than this share of the time since its last cycle.", unit="percent", minimum=0,
        maximum=100)
    min_accuracy_percent: float = setting(
        90.0, "Back off when refaults exceed (100 - this) percent of the pages reclaimed.",
        unit="percent", minimum=0, maximum=100)
    min_efficiency_percent: float = setting(
        50.0, "Halve the step when pages reclaimed are under this share of pages scanned.",
        unit="percent", minimum=0, maximum=100)
    max_bytes_per_s: int = setting(
        64 << 20, "Reclaim bandwidth of all containers together.", unit="bytes per second",
        minimum=PAGE_SIZE, maximum=1 << 40)
    step_timeout_s: float = setting(
        5.0, "A step still reclaiming after this is killed.", unit="seconds", minimum=0.1,
        maximum=600)


class OffloadSections(Protocol):
    """The sections the offloading loop reads."""

    @property
    def reconciler(self) -> ReconcilerConfig: ...

    @property
    def offload(self) -> OffloadConfig: ...


# -- the pure controller ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Counters:
    """One container's readings at one moment."""

    stall_us: int  # memory.pressure: some total= (µs)
    pgscan: int
    pgsteal: int
    refault: int  # workingset_refault_anon + workingset_refault_file
    inactive_file: int  # bytes
    inactive_anon: int  # bytes


@dataclass(frozen=True, slots=True)
class Track:
    """What the controller keeps of one container between cycles."""

    at: float
    counters: Counters
    percent: float
    asked: int = 0  # bytes the last step asked (0: none taken)
    reclaimed: int = 0  # bytes the kernel reclaimed in it


# Verdicts: why a container's step is what it is.
FIRST = "first"  # its first cycle: counters read, nothing asked
GROW = "grow"
FAST_GROW = "fast_grow"
STALL = "stall"
REFAULT = "refault"
SCAN = "scan"


@dataclass(frozen=True, slots=True)
class Decision:
    ask: int  # bytes, before the node's budget
    percent: float  # the share of the base this step asks
    verdict: str
    base: int  # the memory the step is a share of
    stall_us_per_s: float = 0.0
    refault_ratio: float | None = None  # Δrefault / Δpgsteal; None: neither moved
    refaults_per_s: float = 0.0


def eligible(level: str, annotations: Mapping[str, str], cfg: OffloadConfig) -> bool:
    """Whether a container of a pod at ``level`` with ``annotations`` may be offloaded."""
    if level == QosLevel.RECLAIMED_CORES:
        return True
    return (level == QosLevel.SHARED_CORES and cfg.shared_cores
            and annotations.get(cfg.annotation, "").strip().lower() == "true")


def anon_allowed(cfg: OffloadConfig, swap_total_bytes: int, swap_max: str | None) -> bool:
    """Anonymous memory may be offloaded: allowed by the config, swap on the node, and the
    container's ``memory.swap.max`` (None: no such file, no per-cgroup limit) not 0."""
    return (cfg.anon and swap_total_bytes > 0
            and (swap_max is None or swap_max.strip() != "0"))


def decide(cfg: OffloadConfig, previous: Track | None, now: float, counters: Counters,
           anon: bool) -> Decision:
    """The formula of the module doc for one container."""
    base = counters.inactive_file + (counters.inactive_anon if anon else 0)
    if previous is None:
        return Decision(0, cfg.initial_percent, FIRST, base)
    elapsed = max(now - previous.at, 1e-6)
    before = previous.counters
    stall = max(counters.stall_us - before.stall_us, 0) / elapsed
    steal = max(counters.pgsteal - before.pgsteal, 0)
    scan = max(counters.pgscan - before.pgscan, 0)
    refaults = max(counters.refault - before.refault, 0)
    ratio = refaults / steal if steal else (None if not refaults else float("inf"))
    shrunk = max(previous.percent / 2, MIN_PERCENT)

    def made(percent: float, verdict: str, ask: bool = True) -> Decision:
        size = min(int(percent / 100 * base), cfg.max_step_bytes) // PAGE_SIZE * PAGE_SIZE
        if not ask or size < cfg.min_step_bytes:
            size = 0
        return Decision(size, percent, verdict, base, stall, ratio, refaults / elapsed)

    # Compared in whole percent, not as ratios: 1 - 90 / 100 is 0.0999... in floating point,
    # and a refault ratio of exactly 10 % would back off where the setting says it holds.
    if max(counters.stall_us - before.stall_us, 0) * 100 > cfg.max_stall_percent * 1e6 * elapsed:
        return made(shrunk, STALL, ask=False)
    if refaults * 100 > (100 - cfg.min_accuracy_percent) * steal:
        return made(shrunk, REFAULT, ask=False)
    if scan and steal * 100 < cfg.min_efficiency_percent * scan:
        return made(shrunk, SCAN)
    if not previous.asked:
        return made(previous.percent, GROW)
    fast = previous.reclaimed >= previous.asked and refaults == 0
    step = cfg.fast_grow_percent if fast else cfg.grow_percent
    return made(min(previous.percent + step, cfg.max_step_percent), FAST_GROW if fast else GROW)


def budget(cfg: OffloadConfig, since_last: float | None) -> int:
    """Bytes all containers may ask this cycle: the rate over the time since the last cycle,
    never more than one period's worth (an idle stretch is no credit for a burst)."""
    window = cfg.interval_s if since_last is None else min(max(since_last, 0.0), cfg.interval_s)
    return int(cfg.max_bytes_per_s * window)


def share(asks: Sequence[tuple[str, int]], total: int) -> dict[str, int]:
    """``total`` shared among the asks, largest ask first (then by key), each granted what is
    left of it, in whole pages; asks of 0 are left out."""
    granted: dict[str, int] = {}
    left = total
    for key, ask in sorted(asks, key=lambda item: (-item[1], item[0])):
        if ask <= 0:
            continue
        grant = min(ask, left) // PAGE_SIZE * PAGE_SIZE
        if grant > 0:
            granted[key] = grant
            left -= grant
    return granted


class CounterError(ValueError):
    """A container's memory.stat or memory.pressure that does not say what is needed."""


def parse_counters(stat: str, pressure: str) -> Counters:
    """The readings from the text of ``memory.stat`` and ``memory.pressure``."""
    values = _stat_values(stat)
    stall = None
    for line in pressure.splitlines():
        words = line.split()
        if words and words[0] == "some":
            total = dict(w.partition("=")[::2] for w in words[1:]).get("total", "")
            stall = int(total) if total.isdigit() else None
    if stall is None:
        raise CounterError("memory.pressure has no 'some ... total=<µs>' line")
    missing = [k for k in ("pgscan", "pgsteal", "inactive_file", "inactive_anon")
               if k not in values]
    if missing:
        raise CounterError(f"memory.stat lacks {', '.join(missing)}")
    # Linux 5.9 split the refault counter by LRU; older kernels have one.
    refault = (values.get("workingset_refault_anon", 0) + values.get("workingset_refault_file", 0)
               if "workingset_refault_file" in values else values.get("workingset_refault", 0))
    return Counters(stall, values["pgscan"], values["pgsteal"], refault,
                    values["inactive_file"], values["inactive_anon"])


def offload_problem(host: HostInfo) -> str:
    """"" when this host can offload, else why not."""
    if not host.cgroup.v2:
        return "cgroup v1 has no memory.reclaim (offloading needs cgroup v2)"
    if not host.memcg.reclaim:
        return "the kernel has no memory.reclaim (Linux 5.19+)"
    return ""


# -- the loop --------------------------------------------------------------------------------


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
                 host: HostInfo, audit: AuditLog, *, managed: ManagedCache | None = None,
                 ladder_engaged: Callable[[], bool] = lambda: False,
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
        stat = self._sysfs.read(f"{cgroup}/memory.stat")
        pressure = self._sysfs.read(f"{cgroup}/memory.pressure")
        if stat is None or pressure is None:
            return None
        try:
            counters = parse_counters(stat, pressure)
        except CounterError as exc:
            log.warning("offload_unreadable", container=item.view.info.name, error=str(exc))
            return None
        anon = anon_allowed(off, swap, self._sysfs.read(f"{cgroup}/memory.swap.max"))
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
        # The kernel answers EAGAIN when it reclaimed less than asked: a short step, not a fault.
        if outcome is Outcome.FAILED and error.startswith("EAGAIN"):
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
    old, new = _stat_values(before), _stat_values(after)
    found: dict[str, int] = {}
    for key in ("pgsteal", "file", "anon"):
        if key in old and key in new:
            change = new[key] - old[key] if key == "pgsteal" else old[key] - new[key]
            found[key] = max(change, 0) * (PAGE_SIZE if key == "pgsteal" else 1)
    return found


def _stat_values(text: str) -> dict[str, int]:
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[key] = int(value)
    return values
