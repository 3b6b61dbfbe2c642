"""resctrl policy: what the hardware offers, and allocations translated into schemata values.

Pure: the filesystem side lives in :mod:`reconciler.host.resctrlfs`, pod annotations in
:mod:`hooks.resctrl_annotation`, group names and placement in :mod:`hooks.resctrl_groups`.
Allocations are expressed in percent (an L3 way range and a memory-bandwidth share, each
optionally per cache id) and translated here into schemata values for the hardware at hand:

* L3: a contiguous capacity bitmask (Intel requires contiguous masks; AMD accepts them) inside
  ``cbm_mask``, at least ``min_cbm_bits`` wide. The range start is rounded down and the end up to
  whole ways, so a request never gets less than it asked for.
* MB on Intel: a percentage rounded up to ``bandwidth_gran`` and at least ``min_bandwidth``.
* MB on AMD: absolute units (``amd_mb_max`` means 100 %), at least 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from hooks.resctrl_config import ResctrlLevel

_EMPTY_RANGES: Mapping[int, tuple[int, int]] = MappingProxyType({})
_EMPTY_INTS: Mapping[int, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ResctrlInfo:
    """What the resctrl hardware offers, as read from ``info/`` and the root ``schemata``."""

    num_closids: int
    # Full L3 capacity bitmask (info/L3/cbm_mask); 0 when L3 allocation is unavailable.
    cbm_mask: int = 0
    min_cbm_bits: int = 1
    l3_ids: tuple[int, ...] = ()
    mb_ids: tuple[int, ...] = ()
    mb_gran: int = 10
    mb_min: int = 10
    mb_delay_linear: bool = True
    # MB values are absolute (AMD) rather than percent (Intel); mb_max is the "unthrottled" value.
    mb_absolute: bool = False
    mb_max: int = 100
    # info/L3_MON present: monitor groups (mon_groups) can be created.
    monitoring: bool = False

    @property
    def cbm_bits(self) -> int:
        return self.cbm_mask.bit_length()

    @property
    def has_l3(self) -> bool:
        return self.cbm_mask > 0 and bool(self.l3_ids)

    @property
    def has_mb(self) -> bool:
        return bool(self.mb_ids)


@dataclass(frozen=True, slots=True)
class Allocation:
    """A request in percent; ``None`` means "not asked for"."""

    l3: tuple[int, int] | None = None
    mb: int | None = None
    l3_per_cache: Mapping[int, tuple[int, int]] = field(default_factory=lambda: _EMPTY_RANGES)
    mb_per_cache: Mapping[int, int] = field(default_factory=lambda: _EMPTY_INTS)

    @property
    def asks_l3(self) -> bool:
        return self.l3 is not None or bool(self.l3_per_cache)

    @property
    def asks_mb(self) -> bool:
        return self.mb is not None or bool(self.mb_per_cache)


@dataclass(frozen=True, slots=True)
class Schemata:
    """Schemata values per cache id: L3 capacity bitmasks and MB values in the kernel's unit."""

    l3: Mapping[int, int] = field(default_factory=lambda: _EMPTY_INTS)
    mb: Mapping[int, int] = field(default_factory=lambda: _EMPTY_INTS)

    def lines(self) -> tuple[str, ...]:
        out = []
        if self.l3:
            out.append("L3:" + ";".join(f"{cid}={mask:x}" for cid, mask in sorted(self.l3.items())))
        if self.mb:
            out.append("MB:" + ";".join(f"{cid}={v}" for cid, v in sorted(self.mb.items())))
        return tuple(out)


def l3_mask(start_percent: int, end_percent: int, info: ResctrlInfo) -> int:
    """Contiguous CBM covering ``[start, end)`` percent of the ways, at least min_cbm_bits wide."""
    ways = info.cbm_bits
    if ways == 0:
        raise ValueError("no L3 allocation on this host")
    first = min(start_percent * ways // 100, ways - 1)
    last = max(math.ceil(end_percent * ways / 100), first + 1)
    count = min(max(last - first, info.min_cbm_bits, 1), ways)
    first = min(first, ways - count)
    return ((1 << count) - 1) << first


def mb_value(percent: int, info: ResctrlInfo) -> int:
    """Memory-bandwidth value for ``percent`` in the kernel's unit for this host."""
    if info.mb_absolute:
        return max(1, min(info.mb_max, math.ceil(percent * info.mb_max / 100)))
    gran = max(info.mb_gran, 1)
    value = math.ceil(percent / gran) * gran
    return max(info.mb_min, min(value, 100))


def build_schemata(alloc: Allocation, info: ResctrlInfo) -> Schemata:
    """Schemata for every cache id of the host; unasked resources get their full share."""
    l3: dict[int, int] = {}
    mb: dict[int, int] = {}
    if info.has_l3:
        for cid in info.l3_ids:
            start, end = alloc.l3_per_cache.get(cid, alloc.l3 or (0, 100))
            l3[cid] = l3_mask(start, end, info)
    if info.has_mb:
        for cid in info.mb_ids:
            pct = alloc.mb_per_cache.get(cid, 100 if alloc.mb is None else alloc.mb)
            mb[cid] = mb_value(pct, info)
    return Schemata(MappingProxyType(l3), MappingProxyType(mb))


def level_allocation(level: ResctrlLevel) -> Allocation:
    """A class group's allocation from its config section."""
    l3_per: dict[int, tuple[int, int]] = {}
    mb_per: dict[int, int] = {}
    for key, override in level.per_cache.items():
        l3_per[int(key)] = (override.l3_start_percent, override.l3_end_percent)
        mb_per[int(key)] = override.mb_percent
    return Allocation(
        l3=(level.l3_start_percent, level.l3_end_percent),
        mb=level.mb_percent,
        l3_per_cache=MappingProxyType(l3_per),
        mb_per_cache=MappingProxyType(mb_per),
    )


def fit_mask(mask: int, within: int) -> int:
    """Contiguous ``mask`` moved (never widened) into contiguous ``within``."""
    if mask & ~within == 0:
        return mask
    count = mask.bit_count()
    if count >= within.bit_count():
        return within
    lowest = (within & -within).bit_length() - 1
    highest = within.bit_length() - 1
    first = (mask & -mask).bit_length() - 1
    first = min(max(first, lowest), highest - count + 1)
    return ((1 << count) - 1) << first


def class_schemata(level: ResctrlLevel, info: ResctrlInfo) -> Schemata:
    return build_schemata(level_allocation(level), info)
