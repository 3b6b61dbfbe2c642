"""resctrl policy: hardware description, pod annotations, CBM / MB translation and group names.

Pure: the filesystem side lives in :mod:`reconciler.resctrlfs`. Allocations are expressed in
percent (an L3 way range and a memory-bandwidth share, each optionally per cache id) and
translated here into schemata values for the hardware at hand:

* L3: a contiguous capacity bitmask (Intel requires contiguous masks; AMD accepts them) inside
  ``cbm_mask``, at least ``min_cbm_bits`` wide. The range start is rounded down and the end up to
  whole ways, so a request never gets less than it asked for.
* MB on Intel: a percentage rounded up to ``bandwidth_gran`` and at least ``min_bandwidth``.
* MB on AMD: absolute units (``amd_mb_max`` means 100 %), at least 1.

Pod annotations (Koordinator's ``node.koordinator.sh/resctrl`` and ``qos.nri-qos.io/resctrl``, same
JSON shape)::

    {"LLC": {"schemata": {"range": [20, 80]},
             "schemataPerCache": [{"cacheID": 1, "range": [0, 50]}]},
     "MB":  {"schemata": {"percent": 20}}}

Keys match case-insensitively (as Go's JSON decoder does, so ``cacheid`` and ``cacheID`` are the
same key); a missing ``cacheID`` means cache 0 (Koordinator omits zero values). ``LLC`` takes a
``range`` or a ``percent`` (``percent: N`` = ``range: [0, N]``), ``MB`` only a ``percent``. A pod
never gets more than its level's class group or the admin caps allow: a request outside them is
rejected (that part is skipped and reported), never silently widened.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hooks.annotation_json import json_object
from hooks.model import PodInfo
from nri_plugin.config.creation import ResctrlConfig, ResctrlLevel

KOORDINATOR_ANNOTATION = "node.koordinator.sh/resctrl"
# Larger annotations are refused before parsing: nothing legitimate comes close.
MAX_ANNOTATION_CHARS = 4096
# Kubernetes uids are RFC 4122 strings; anything else never becomes a path component.
_UID_RE = re.compile(r"[A-Za-z0-9-]{1,64}")
_GROUP_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")
# Names that resctrl uses for its own files and directories inside a group.
_RESERVED = frozenset({"info", "mon_groups", "mon_data", "tasks", "cpus", "cpus_list",
                       "schemata", "mode", "size", "mon_hw_id", "ctrl_hw_id"})
POD_MARK = "pod-"
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

    def text(self) -> str:
        return "".join(line + "\n" for line in self.lines())

    def matches(self, current: Mapping[str, Mapping[int, str]]) -> bool:
        """True when ``current`` (see :func:`parse_schemata`) already holds every value here."""
        try:
            return (all(int(current.get("L3", {})[cid], 16) == v for cid, v in self.l3.items())
                    and all(int(current.get("MB", {})[cid]) == v for cid, v in self.mb.items()))
        except (KeyError, ValueError):
            return False


def parse_schemata(text: str) -> dict[str, dict[int, str]]:
    """``"L3:0=7ff;1=7ff\\n  MB:0=100;1=100"`` -> ``{"L3": {0: "7ff", 1: "7ff"}, ...}``.

    The kernel right-aligns resource names, hence the stripping; malformed entries are skipped.
    """
    result: dict[str, dict[int, str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        name, sep, rest = line.partition(":")
        if not sep or not name:
            continue
        entries = result.setdefault(name.strip(), {})
        for item in rest.split(";"):
            cid, eq, value = item.strip().partition("=")
            if eq and cid.strip().isdigit():
                entries[int(cid)] = value.strip()
    return result


# --- translation -----------------------------------------------------------------------------

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


# --- group names -----------------------------------------------------------------------------

def valid_group_name(name: str) -> bool:
    """A name that is safe as one directory component below the resctrl root."""
    return (bool(_GROUP_RE.fullmatch(name)) and ".." not in name
            and not name.startswith(".") and name not in _RESERVED)


def class_group_name(prefix: str, level: str) -> str:
    return prefix + level


def pod_group_name(prefix: str, uid: str) -> str | None:
    """``<prefix>pod-<uid>``, or None when the uid is not a plain uid."""
    if not _UID_RE.fullmatch(uid):
        return None
    return f"{prefix}{POD_MARK}{uid}"


@dataclass(frozen=True, slots=True)
class GroupRef:
    """What one of our group names stands for: ``kind`` is "class" (key = level) or "pod"."""

    kind: str
    key: str


def parse_group_name(prefix: str, name: str, levels: tuple[str, ...]) -> GroupRef | None:
    """Inverse of the two name builders; None for groups that are not ours."""
    if not name.startswith(prefix) or not valid_group_name(name):
        return None
    rest = name[len(prefix):]
    if rest in levels:
        return GroupRef("class", rest)
    if rest.startswith(POD_MARK) and _UID_RE.fullmatch(rest[len(POD_MARK):]):
        return GroupRef("pod", rest[len(POD_MARK):])
    return None


# --- pod annotations -------------------------------------------------------------------------

class _Bad(Exception):
    """One part of an annotation is invalid; the message says why."""


def _keys(obj: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    """Lower-case the keys (Go's decoder matches them case-insensitively); reject unknown ones."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        low = key.lower()
        if low not in allowed:
            raise _Bad(f"{where}: unknown key {key!r}")
        if low in out:
            raise _Bad(f"{where}: duplicate key {key!r}")
        out[low] = value
    return out


def _int(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"{where}: must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise _Bad(f"{where}: must be {low}..{high}, got {value}")
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"{where}: must be an object, got {type(value).__name__}")
    return value


def _l3_range(entry: Mapping[str, Any], where: str) -> tuple[int, int]:
    if "range" in entry and "percent" in entry:
        raise _Bad(f"{where}: give either range or percent, not both")
    if "percent" in entry:
        return (0, _int(entry["percent"], f"{where}.percent", 1, 100))
    if "range" not in entry:
        raise _Bad(f"{where}: needs range or percent")
    rng = entry["range"]
    if not isinstance(rng, list) or len(rng) != 2:
        raise _Bad(f"{where}.range: must be [start, end]")
    start = _int(rng[0], f"{where}.range[0]", 0, 99)
    end = _int(rng[1], f"{where}.range[1]", 1, 100)
    if end <= start:
        raise _Bad(f"{where}.range: end must be greater than start, got [{start}, {end}]")
    return (start, end)


def _mb_percent(entry: Mapping[str, Any], where: str) -> int:
    if "range" in entry:
        raise _Bad(f"{where}: MB takes a percent, not a range")
    if "percent" not in entry:
        raise _Bad(f"{where}: needs percent")
    return _int(entry["percent"], f"{where}.percent", 1, 100)


def _part(raw: Any, where: str, is_l3: bool) -> tuple[Any, dict[int, Any]]:
    obj = _keys(_object(raw, where), ("schemata", "schematapercache"), where)
    default: Any = None
    per: dict[int, Any] = {}
    if "schemata" in obj:
        sw = f"{where}.schemata"
        entry = _keys(_object(obj["schemata"], sw), ("range", "percent"), sw)
        if entry:
            default = _l3_range(entry, sw) if is_l3 else _mb_percent(entry, sw)
    if "schematapercache" in obj:
        items = obj["schematapercache"]
        if not isinstance(items, list):
            raise _Bad(f"{where}.schemataPerCache: must be a list")
        for i, item in enumerate(items):
            iw = f"{where}.schemataPerCache[{i}]"
            entry = _keys(_object(item, iw), ("cacheid", "range", "percent"), iw)
            cid = _int(entry.pop("cacheid", 0), f"{iw}.cacheID", 0, 4095)
            if cid in per:
                raise _Bad(f"{iw}: cache id {cid} given twice")
            per[cid] = _l3_range(entry, iw) if is_l3 else _mb_percent(entry, iw)
    return default, per


def parse_annotation(text: str) -> tuple[Allocation | None, tuple[str, ...]]:
    """Parse a pod resctrl annotation; each invalid part (LLC, MB) is dropped and reported."""
    doc, problem = json_object(text, MAX_ANNOTATION_CHARS)
    if doc is None:
        return None, (problem or "unusable annotation",)
    problems: list[str] = []
    parts: dict[str, Any] = {}
    for key, value in doc.items():
        low = key.lower()
        if low not in ("llc", "mb") or low in parts:
            problems.append(f"unknown or duplicate key {key!r}")
            continue
        parts[low] = value
    l3: tuple[int, int] | None = None
    mb: int | None = None
    l3_per: dict[int, Any] = {}
    mb_per: dict[int, Any] = {}
    if "llc" in parts:
        try:
            l3, l3_per = _part(parts["llc"], "LLC", is_l3=True)
        except _Bad as exc:
            problems.append(str(exc))
    if "mb" in parts:
        try:
            mb, mb_per = _part(parts["mb"], "MB", is_l3=False)
        except _Bad as exc:
            problems.append(str(exc))
    alloc = Allocation(l3, mb, MappingProxyType(l3_per), MappingProxyType(mb_per))
    if not alloc.asks_l3 and not alloc.asks_mb:
        return None, tuple(problems)
    return alloc, tuple(problems)


@dataclass(frozen=True, slots=True)
class PodPlan:
    """RunPodSandbox decision: the pod group to create (None: use the level's class group)."""

    group: str | None = None
    schemata: Schemata | None = None
    # The annotation the request came from ("" when there was none).
    source: str = ""
    problems: tuple[str, ...] = ()


def _level_bounds(level: ResctrlLevel | None, cid: int) -> tuple[int, int, int]:
    """(L3 start, L3 end, MB) a pod of this level may use on cache ``cid``."""
    if level is None or not level.enabled:
        return (0, 100, 100)
    override = level.per_cache.get(str(cid))
    if override is not None:
        return (override.l3_start_percent, override.l3_end_percent, override.mb_percent)
    return (level.l3_start_percent, level.l3_end_percent, level.mb_percent)


def _bounded(alloc: Allocation, level: ResctrlLevel | None, cfg: ResctrlConfig,
             info: ResctrlInfo) -> tuple[Allocation, list[str]]:
    """Check every cache id's request against the level's share and the admin caps."""
    problems: list[str] = []
    l3: dict[int, tuple[int, int]] = {}
    mb: dict[int, int] = {}
    l3_ok = mb_ok = True
    for cid in sorted(set(alloc.l3_per_cache) - set(info.l3_ids)):
        problems.append(f"LLC: no L3 cache id {cid} on this node")
        l3_ok = False
    for cid in sorted(set(alloc.mb_per_cache) - set(info.mb_ids)):
        problems.append(f"MB: no MB cache id {cid} on this node")
        mb_ok = False
    for cid in info.l3_ids if info.has_l3 else ():
        lo, hi, _ = _level_bounds(level, cid)
        hi = min(hi, cfg.pod_l3_max_percent)
        wanted = alloc.l3_per_cache.get(cid, alloc.l3)
        if wanted is None:
            l3[cid] = (lo, max(hi, lo + 1))
        elif wanted[0] < lo or wanted[1] > hi:
            problems.append(f"LLC: range {list(wanted)} on cache {cid} is outside the allowed "
                            f"[{lo}, {hi}]")
            l3_ok = False
        else:
            l3[cid] = wanted
    for cid in info.mb_ids if info.has_mb else ():
        _, _, cap = _level_bounds(level, cid)
        cap = min(cap, cfg.pod_mb_max_percent)
        want = alloc.mb_per_cache.get(cid, alloc.mb)
        if want is None:
            mb[cid] = max(cap, 1)
        elif want > cap:
            problems.append(f"MB: {want} % on cache {cid} is above the allowed {cap} %")
            mb_ok = False
        else:
            mb[cid] = want
    asked_l3 = alloc.asks_l3 and l3_ok and info.has_l3
    asked_mb = alloc.asks_mb and mb_ok and info.has_mb
    if not asked_l3 and not asked_mb:
        return Allocation(), problems
    # A rejected part falls back to the level's share, so the group still never exceeds it.
    if not l3_ok:
        l3 = {cid: (lo, max(min(hi, cfg.pod_l3_max_percent), lo + 1))
              for cid in info.l3_ids
              for lo, hi, _ in (_level_bounds(level, cid),)}
    if not mb_ok:
        mb = {cid: max(min(_level_bounds(level, cid)[2], cfg.pod_mb_max_percent), 1)
              for cid in info.mb_ids}
    bounded = Allocation(l3_per_cache=MappingProxyType(l3), mb_per_cache=MappingProxyType(mb))
    return bounded, problems


def plan_pod_group(pod: PodInfo, level: str, cfg: ResctrlConfig, info: ResctrlInfo) -> PodPlan:
    """Decide whether ``pod`` gets its own group, and with which schemata."""
    if not cfg.pod_groups:
        return PodPlan()
    source = ""
    if cfg.annotation in pod.annotations:
        source = cfg.annotation
    elif cfg.koordinator_annotation and KOORDINATOR_ANNOTATION in pod.annotations:
        source = KOORDINATOR_ANNOTATION
    if not source:
        return PodPlan()
    alloc, problems = parse_annotation(pod.annotations[source])
    if alloc is None:
        return PodPlan(source=source, problems=problems)
    name = pod_group_name(cfg.group_prefix, pod.uid)
    if name is None:
        return PodPlan(source=source, problems=(*problems, f"pod uid {pod.uid!r} is not a uid"))
    level_cfg = cfg.levels.get(level)
    bounded, more = _bounded(alloc, level_cfg, cfg, info)
    problems = (*problems, *more)
    if not bounded.asks_l3 and not bounded.asks_mb:
        return PodPlan(source=source, problems=problems)
    schemata = build_schemata(bounded, info)
    if level_cfg is not None and info.has_l3:
        schemata = _within(schemata, class_schemata(level_cfg, info))
    return PodPlan(name, schemata, source, problems)


def _within(pod: Schemata, level: Schemata) -> Schemata:
    """Keep each of the pod's L3 masks inside its level's ways.

    The percent bounds hold before translation, but widening a mask to ``min_cbm_bits`` can push
    it past the level's last (or first) way; slide it back inside.
    """
    l3 = {cid: fit_mask(mask, level.l3.get(cid, mask)) for cid, mask in pod.l3.items()}
    return Schemata(MappingProxyType(l3), pod.mb)


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
