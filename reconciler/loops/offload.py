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
needs a swap device too) and the container and every cgroup above it (pod, tier, ``kubepods``)
have room under their ``memory.swap.max`` (not ``0``, not full: the kernel charges swap to all
of them); otherwise the base is the inactive file memory only, since without swap the kernel
cannot reclaim anonymous memory.
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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from hooks.config_fields import setting
from hooks.levels import QosLevel
from reconciler.host import parse
from reconciler.host.memstat import refault_pages
from reconciler.host.probe import HostInfo
from reconciler.host.values import PAGE_SIZE
from reconciler.loops.base import ReconcilerConfig

log = structlog.get_logger("nri_qos.reconciler")

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
        "container and the cgroups above it have room under their memory.swap.max; else file "
        "cache only.")
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


def parse_counters(stat: str, pressure: str) -> Counters:
    """The readings from the text of ``memory.stat`` and ``memory.pressure``; a
    :class:`ParseError` where either does not say what is needed."""
    values = parse.parse_counters(stat)
    stall = parse.parse_psi(pressure).some_total_us
    scan, steal, inactive_file, inactive_anon = parse.require(
        values, ("pgscan", "pgsteal", "inactive_file", "inactive_anon"), "memory.stat")
    refault = refault_pages(values, v2=True) or 0
    return Counters(stall, scan, steal, refault, inactive_file, inactive_anon)


def offload_problem(host: HostInfo) -> str:
    """"" when this host can offload, else why not."""
    if not host.cgroup.v2:
        return "cgroup v1 has no memory.reclaim (offloading needs cgroup v2)"
    if not host.memcg.reclaim:
        return "the kernel has no memory.reclaim (Linux 5.19+)"
    if not host.psi.cgroups:
        # Each step is judged by the container's stalls: without them nothing would be taken.
        return ("the cgroups have no memory.pressure (PSI off for cgroups: "
                "cgroup_disable=pressure), which offloading backs off on")
    return ""
