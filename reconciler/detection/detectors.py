"""The detectors: kernel file text in, a graded :class:`Sample` out; pure, no I/O.

Each function grades one observation against the thresholds of the three levels; the detection
service smooths the samples (:mod:`.smoothing`) into the readings it publishes. Text that does
not parse gives an ``unknown`` sample with the reason, never ``none``. Formulas and defaults:
``docs/detection.md``.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from hooks.untrusted import bounded_repr
from reconciler.detection.config import (
    FULFILLMENT,
    KSWAPD,
    MIN_RSS_OVERUSE_FACTOR,
    NUMA_FREE,
    PRESSURE_LEVEL,
    PSI,
    REFAULT,
    RSS_OVERUSE,
    SYSTEM_FREE,
    DetectionConfig,
)
from reconciler.detection.signals import NODE, Level, Reading, numa_scope, pod_scope
from reconciler.host.memstat import ANON_KEYS, refault_pages
from reconciler.host.numa import (
    MEMINFO,
    VMSTAT,
    NumaFormatError,
    parse_meminfo,
)
from reconciler.host.parse import (
    ParseError,
    parse_counters,
    parse_int,
    parse_psi,
    require,
)
from reconciler.host.values import parse_bytes

GRADED = (Level.LOW, Level.MEDIUM, Level.HIGH)
Thresholds = tuple[float | None, float | None, float | None]
"""The thresholds of LOW, MEDIUM and HIGH; None where a detector does not use the level."""

RECLAIMED_TIER = "tier:reclaimed_cores"
"""Scope of the fulfillment reading: the reclaimed tier as the memory guard supplies it."""


@dataclass(frozen=True, slots=True)
class Sample:
    """A detector's raw verdict on one observation, before smoothing."""

    detector: str
    scope: str
    level: Level
    value: float
    unit: str
    thresholds: Thresholds
    reason: str = ""
    pod_uid: str | None = None
    at: float = 0.0

    @property
    def key(self) -> tuple[str, str]:
        return (self.detector, self.scope)

    def threshold(self, level: Level) -> float:
        """The threshold of ``level`` (of LOW for NONE; 0 for UNKNOWN or an unused level)."""
        if level is Level.UNKNOWN:
            return 0.0
        index = max(int(level), int(Level.LOW)) - 1
        found = self.thresholds[index]
        return 0.0 if found is None else found

    def reading(self, level: Level) -> Reading:
        """The published reading, at the (smoothed) ``level``."""
        return Reading(self.detector, self.scope, level, self.value, self.threshold(level),
                       self.unit, self.reason, self.pod_uid, self.at, self.level)


def unknown(detector: str, scope: str, reason: str, at: float,
            pod_uid: str | None = None) -> Sample:
    return Sample(detector, scope, Level.UNKNOWN, 0.0, "", (None, None, None), reason,
                  pod_uid, at)


def grade_rising(value: float, thresholds: Thresholds) -> Level:
    """The highest level whose threshold ``value`` reaches (higher is worse)."""
    reached = [lvl for lvl, t in zip(GRADED, thresholds, strict=True)
               if t is not None and value >= t]
    return max(reached, default=Level.NONE)


def grade_falling(value: float, thresholds: Thresholds) -> Level:
    """The highest level whose threshold ``value`` is below (lower is worse)."""
    reached = [lvl for lvl, t in zip(GRADED, thresholds, strict=True)
               if t is not None and value < t]
    return max(reached, default=Level.NONE)


# -- free memory against the watermark ------------------------------------------------------------

def watermark(total: int, wsf: int, zone_low: int, floor: int, cfg: DetectionConfig) -> int:
    """W = max(min(floor, total x free_floor_percent / 100),
    total x watermark_scale_factor / 10000 x wsf_factor, zones' low watermarks x zone_low_factor),
    in bytes."""
    bounded = min(floor, int(total * cfg.free_floor_percent / 100))
    return int(max(bounded, total * wsf / 10000 * cfg.free_wsf_factor,
                   zone_low * cfg.free_zone_low_factor))


def _free_sample(detector: str, scope: str, free: int, mark: int, cfg: DetectionConfig,
                 at: float) -> Sample:
    thresholds: Thresholds = (mark * cfg.free_low_margin, float(mark),
                              mark * cfg.free_high_fraction)
    return Sample(detector, scope, grade_falling(free, thresholds), float(free), "bytes",
                  thresholds, f"free {free} B, watermark {mark} B", at=at)


def _wsf(text: str | None) -> int:
    """vm.watermark_scale_factor; a kernel without it (before 4.6) has no such term."""
    return 0 if text is None else parse_int(text)


def system_free(meminfo: str, zone_low: int, wsf: str | None, numa_nodes: int,
                cfg: DetectionConfig, at: float) -> Sample:
    """``/proc/meminfo`` MemFree (page cache is not free) against W for the whole machine (the
    floor once per NUMA node); ``zone_low``: every zone's low watermark summed, in bytes."""
    try:
        info = parse_meminfo(meminfo)
        free, total = info["MemFree"], info["MemTotal"]
        mark = watermark(total, _wsf(wsf), zone_low, cfg.free_floor_bytes * max(numa_nodes, 1),
                         cfg)
    except (ParseError, NumaFormatError) as exc:
        return unknown(SYSTEM_FREE, NODE, str(exc), at)
    except KeyError as exc:
        return unknown(SYSTEM_FREE, NODE, f"{MEMINFO} lacks {exc.args[0]}", at)
    return _free_sample(SYSTEM_FREE, NODE, free, mark, cfg, at)


def numa_free(node_meminfo: Mapping[int, str | None], lows: Mapping[int, int],
              wsf: str | None, cfg: DetectionConfig, at: float) -> list[Sample]:
    """Each NUMA node's MemFree against its own W (its zones' low watermarks in ``lows``, bytes
    per node; its total)."""
    try:
        scale = _wsf(wsf)
    except ParseError as exc:
        return [unknown(NUMA_FREE, numa_scope(n), str(exc), at) for n in sorted(node_meminfo)]
    samples = []
    for node in sorted(node_meminfo):
        text = node_meminfo[node]
        scope = numa_scope(node)
        if text is None:
            samples.append(unknown(NUMA_FREE, scope, "node meminfo is gone", at))
            continue
        try:
            info = parse_meminfo(text)
            free, total = info["MemFree"], info["MemTotal"]
        except NumaFormatError as exc:
            samples.append(unknown(NUMA_FREE, scope, str(exc), at))
            continue
        except KeyError as exc:
            samples.append(unknown(NUMA_FREE, scope, f"node meminfo lacks {exc.args[0]}", at))
            continue
        samples.append(_free_sample(NUMA_FREE, scope,
                                    free, watermark(total, scale, lows.get(node, 0),
                                                    cfg.free_floor_bytes, cfg), cfg, at))
    return samples


# -- PSI ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Stall:
    """The cumulative stall counters of a pressure file at one moment."""

    at: float
    some_us: int
    full_us: int | None


def read_stall(text: str, at: float) -> Stall:
    """Raises :class:`ParseError`."""
    psi = parse_psi(text)
    return Stall(at, psi.some_total_us, psi.full_total_us)


def psi_thresholds(cfg: DetectionConfig) -> Thresholds:
    return (cfg.psi_some_low_percent, cfg.psi_some_medium_percent, cfg.psi_full_high_percent)


def psi_sample(scope: str, before: Stall, now: Stall, cfg: DetectionConfig,
               pod_uid: str | None = None) -> Sample | None:
    """The stall shares between two readings of the cumulative counters, graded: ``some`` for
    LOW and MEDIUM, ``full`` for HIGH. None when no rate can be had (no time passed, or the
    counters went back: the cgroup was made anew)."""
    # Whole microseconds, the counters' unit (see _elapsed).
    elapsed_us = round((now.at - before.at) * 1e6)
    if elapsed_us <= 0 or now.some_us < before.some_us:
        return None
    some = (now.some_us - before.some_us) * 100 / elapsed_us
    full = 0.0
    if now.full_us is not None and before.full_us is not None and now.full_us >= before.full_us:
        full = (now.full_us - before.full_us) * 100 / elapsed_us
    thresholds = psi_thresholds(cfg)
    high = thresholds[2]
    level = max(grade_rising(some, (thresholds[0], thresholds[1], None)),
                Level.HIGH if high is not None and full >= high else Level.NONE)
    value = full if level is Level.HIGH else some
    return Sample(PSI, scope, level, round(value, 3), "percent", thresholds,
                  f"some {some:.1f} % full {full:.1f} % over {elapsed_us / 1000:.0f} ms",
                  pod_uid, now.at)


def psi_trigger_sample(scope: str, window_ms: int, cfg: DetectionConfig, at: float) -> Sample:
    """A PSI trigger fired: the 'some' stall reached the low share of its window."""
    stall_ms = window_ms * cfg.psi_some_low_percent / 100
    return Sample(PSI, scope, Level.LOW, cfg.psi_some_low_percent, "percent",
                  psi_thresholds(cfg),
                  f"PSI trigger: some stall >= {stall_ms:g} ms within {window_ms} ms", at=at)


# -- cgroup v1 memory.pressure_level --------------------------------------------------------------

KERNEL_LEVELS: Mapping[str, Level] = {"low": Level.LOW, "medium": Level.MEDIUM,
                                      "critical": Level.HIGH}
"""The kernel's vmpressure levels: low = reclaiming, medium = reclaim is hitting the working
set (swapping, refaults), critical = about to OOM."""


def pressure_event_sample(scope: str, kernel_level: str, count: int, at: float) -> Sample:
    return Sample(PRESSURE_LEVEL, scope, KERNEL_LEVELS[kernel_level], float(count), "events",
                  (1.0, 1.0, 1.0), f"memory.pressure_level {kernel_level} ({count} events)",
                  at=at)


def pressure_quiet_sample(scope: str, at: float) -> Sample:
    return Sample(PRESSURE_LEVEL, scope, Level.NONE, 0.0, "events", (1.0, 1.0, 1.0),
                  "no memory.pressure_level event since the last sample", at=at)


# -- kswapd ---------------------------------------------------------------------------------------

class Counted(Protocol):
    """Cumulative counters read at one moment."""

    @property
    def at(self) -> float: ...

    @property
    def counters(self) -> tuple[int, ...]: ...


_C = TypeVar("_C", bound=Counted)


@dataclass(frozen=True, slots=True)
class Reclaim:
    """kswapd's cumulative reclaim counters (pages) at one moment."""

    at: float
    steal: int
    scan: int

    @property
    def counters(self) -> tuple[int, ...]:
        return (self.steal, self.scan)


def read_reclaim(vmstat: str, at: float) -> Reclaim:
    """``pgsteal_kswapd`` and ``pgscan_kswapd`` (older kernels split them per zone:
    ``pgsteal_kswapd_normal`` ...; summed). Raises :class:`ParseError`."""
    values = parse_counters(vmstat)
    steal = [v for k, v in values.items() if k.startswith("pgsteal_kswapd")]
    scan = [v for k, v in values.items() if k.startswith("pgscan_kswapd")]
    if not steal or not scan:
        raise ParseError(f"{VMSTAT} lacks pgsteal_kswapd/pgscan_kswapd")
    return Reclaim(at, sum(steal), sum(scan))


def rates_used(low: float, medium: float, high: float) -> Thresholds:
    """Rate thresholds of LOW, MEDIUM and HIGH; a level whose rate is 0 is not used."""
    return (low or None, medium or None, high or None)


def _elapsed(before: float, now: float) -> float:
    """Seconds from ``before`` to ``now``, to the microsecond: clock readings are binary
    fractions, and 16.1 - 6.1 is 10.000000000000002, which would put a rate of exactly a
    threshold just below it, or a sample exactly a window old inside the window."""
    return round(now - before, 6)


def keep_window(history: deque[_C], now: float, window_s: float) -> None:
    """Drop from ``history`` (oldest first) the samples :func:`window_rates` no longer needs:
    all before the last one at least ``window_s`` old at ``now``, keeping at least two."""
    while len(history) > 2 and _elapsed(history[1].at, now) >= window_s:
        history.popleft()


def window_rates(history: Sequence[Counted], window_s: float
                 ) -> tuple[float, tuple[float, ...]] | None:
    """The seconds covered and each counter's rate per second over the last ``window_s`` of
    ``history`` (oldest first). A counter that went back (a reset, a wrap, a cgroup made anew)
    starts the history afresh: never a spike. None without two usable samples."""
    start = 0
    for i in range(1, len(history)):
        if any(b < a for a, b in zip(history[i - 1].counters, history[i].counters, strict=True)):
            start = i
    usable = history[start:]
    if len(usable) < 2:
        return None
    last = usable[-1]
    base = usable[0]
    for sample in usable[:-1]:
        if _elapsed(sample.at, last.at) >= window_s:
            base = sample
    elapsed = _elapsed(base.at, last.at)
    if elapsed <= 0:
        return None
    return elapsed, tuple((b - a) / elapsed
                          for a, b in zip(base.counters, last.counters, strict=True))


def kswapd_sample(history: Sequence[Reclaim], cfg: DetectionConfig) -> Sample | None:
    """kswapd's reclaim rate (pages/s) over the last ``kswapd_window_s`` (see
    :func:`window_rates`). None without two samples."""
    found = window_rates(history, cfg.kswapd_window_s)
    if found is None:
        return None
    elapsed, (steal, scan) = found
    thresholds = rates_used(cfg.kswapd_low_pages_per_s, cfg.kswapd_medium_pages_per_s,
                            cfg.kswapd_high_pages_per_s)
    return Sample(KSWAPD, NODE, grade_rising(steal, thresholds), round(steal, 1), "pages/s",
                  thresholds, f"kswapd stole {steal:.0f} and scanned {scan:.0f} pages/s over "
                  f"{elapsed:.1f} s", at=history[-1].at)


# -- online pods' working-set refaults -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Refaults:
    """A pod's cumulative working-set refaults (pages) at one moment."""

    at: float
    pages: int

    @property
    def counters(self) -> tuple[int, ...]:
        return (self.pages,)


def read_refaults(stat: str, v2: bool, at: float) -> Refaults:
    """From the pod cgroup's ``memory.stat`` (:func:`~reconciler.host.memstat.refault_pages`).
    Raises :class:`ParseError`."""
    pages = refault_pages(parse_counters(stat), v2)
    if pages is None:
        raise ParseError("memory.stat has no workingset_refault counters")
    return Refaults(at, pages)


def refault_sample(scope: str, history: Sequence[Refaults], cfg: DetectionConfig,
                   pod_uid: str) -> Sample | None:
    """An online pod's refault rate (pages/s) over the last ``refault_window_s`` (see
    :func:`window_rates`); None without two samples."""
    found = window_rates(history, cfg.refault_window_s)
    if found is None:
        return None
    elapsed, (rate,) = found
    thresholds = rates_used(cfg.refault_low_pages_per_s, cfg.refault_medium_pages_per_s,
                            cfg.refault_high_pages_per_s)
    return Sample(REFAULT, scope, grade_rising(rate, thresholds), round(rate, 1), "pages/s",
                  thresholds, f"read {rate:.0f} pages/s of its working set again over "
                  f"{elapsed:.1f} s", pod_uid, history[-1].at)


# -- RSS overuse ----------------------------------------------------------------------------------

def anonymous_bytes(stat: str, v2: bool) -> int:
    """A pod's anonymous memory from its cgroup's ``memory.stat``, page cache excluded.

    v2: ``anon``. v1: ``total_rss`` (the pod's cgroup holds its containers' cgroups, so the
    hierarchical total; ``rss`` on a leaf). v1 ``rss`` already includes ``rss_huge``
    (measured on kernel 6.18: 32 MiB of THP showed as rss 49 MiB,
    rss_huge 32 MiB), so adding them would count huge pages twice. Raises ParseError."""
    values = parse_counters(stat)
    keys = ANON_KEYS[v2]
    key = next((k for k in keys if k in values), keys[-1])
    return require(values, (key,), "memory.stat")[0]


def pod_factor(annotations: Mapping[str, str], key: str,
               node_factor: float) -> tuple[float, str]:
    """The RSS overuse factor for a pod: its annotation when valid and stricter than the node's,
    else the node's; the second item says why an annotation was not used ("" when it was, or
    when there is none).

    A valid value is a plain decimal number (``1.01``, surrounding ASCII whitespace ignored) from
    :data:`MIN_RSS_OVERUSE_FACTOR` up to the node's factor: ``float()`` would also take ``nan``,
    ``1e-300``, ``1_0`` and digits of other scripts, none of which a pod means as a factor."""
    raw = annotations.get(key)
    if raw is None:
        return node_factor, ""
    text = raw.strip(" \t\n\r\v\f")
    if not _DECIMAL.fullmatch(text):
        return node_factor, f"annotation {key}={bounded_repr(raw)} is not a decimal number"
    factor = float(text)
    if not MIN_RSS_OVERUSE_FACTOR <= factor <= node_factor:
        return node_factor, (f"annotation {key}={bounded_repr(raw)} is outside "
                             f"[{MIN_RSS_OVERUSE_FACTOR:g}, {node_factor:g}]: not stricter than "
                             f"the node's factor, or below the smallest one")
    return factor, ""


_DECIMAL = re.compile(r"[0-9]{1,6}(?:\.[0-9]{1,6})?")


def rss_overuse(pod_uid: str, stat: str | None, v2: bool, request_bytes: int, factor: float,
                at: float) -> Sample:
    """Anonymous memory against the request (LOW at it) and request x factor (HIGH)."""
    scope = pod_scope(pod_uid)
    if stat is None:
        return unknown(RSS_OVERUSE, scope, "memory.stat is gone", at, pod_uid)
    try:
        anon = anonymous_bytes(stat, v2)
    except ParseError as exc:
        return unknown(RSS_OVERUSE, scope, str(exc), at, pod_uid)
    thresholds: Thresholds = (float(request_bytes), None, request_bytes * factor)
    return Sample(RSS_OVERUSE, scope, grade_rising(anon, thresholds), float(anon), "bytes",
                  thresholds, f"anonymous {anon} B, request {request_bytes} B, factor "
                  f"{factor:g}", pod_uid, at)


# -- reclaimed-tier fulfillment -------------------------------------------------------------------

def fulfillment(limit: str | None, requests_bytes: int, cfg: DetectionConfig,
                at: float) -> Sample | None:
    """The memory guard's cap on the reclaimed tier (its limit file) against the sum of the
    reclaimed pods' requests; None when they request nothing or the tier has no cap."""
    if requests_bytes <= 0:
        return None
    if limit is None:
        return unknown(FULFILLMENT, RECLAIMED_TIER, "the tier's limit file is gone", at)
    try:
        supply = parse_bytes(limit)
    except ValueError:
        return unknown(FULFILLMENT, RECLAIMED_TIER,
                       f"limit not understood: {bounded_repr(limit.strip(), 40)}", at)
    if supply is None:
        return None  # no cap: the tier may take what it asked for and more
    thresholds: Thresholds = (cfg.fulfillment_low_ratio, cfg.fulfillment_medium_ratio,
                              cfg.fulfillment_high_ratio)
    ratio = supply / requests_bytes
    return Sample(FULFILLMENT, RECLAIMED_TIER, grade_falling(ratio, thresholds),
                  round(ratio, 4), "ratio", thresholds,
                  f"cap {supply} B for requests of {requests_bytes} B", at=at)
