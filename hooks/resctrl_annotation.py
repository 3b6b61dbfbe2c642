"""resctrl pod annotations: a pod's own L3/MB request, bounded by its level and the admin caps.

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

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from hooks.annotation_json import json_object
from hooks.model import PodInfo
from hooks.resctrl import (
    Allocation,
    ResctrlInfo,
    Schemata,
    build_schemata,
    class_schemata,
    fit_mask,
)
from hooks.resctrl_config import ResctrlConfig, ResctrlLevel
from hooks.resctrl_groups import pod_group_name
from hooks.untrusted import bounded_repr

KOORDINATOR_ANNOTATION = "node.koordinator.sh/resctrl"
# Larger annotations are refused before parsing: nothing legitimate comes close.
MAX_ANNOTATION_CHARS = 4096


class _Bad(Exception):
    """One part of an annotation is invalid; the message says why."""


def _keys(obj: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    """Lower-case the keys (Go's decoder matches them case-insensitively); reject unknown ones."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        low = key.lower()
        if low not in allowed:
            raise _Bad(f"{where}: unknown key {bounded_repr(key)}")
        if low in out:
            raise _Bad(f"{where}: duplicate key {bounded_repr(key)}")
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
    unknown: list[str] = []
    for key, value in doc.items():
        low = key.lower()
        if low not in ("llc", "mb") or low in parts:
            unknown.append(key)
            continue
        parts[low] = value
    if unknown:
        # One problem for all of them: a 4 KiB annotation holds hundreds of keys.
        problems.append(f"unknown or duplicate key{'s' if len(unknown) > 1 else ''} "
                        f"{_listed([bounded_repr(key, 32) for key in unknown])}")
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


def _listed(items: list[str], shown: int = 4) -> str:
    """``a, b, c, d and 7 more``: a list whose length the input decides, kept short."""
    text = ", ".join(items[:shown])
    return f"{text} and {len(items) - shown} more" if len(items) > shown else text


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
    # One problem per part, whatever the number of ids the annotation names.
    if missing := sorted(set(alloc.l3_per_cache) - set(info.l3_ids)):
        problems.append(f"LLC: no L3 cache id {_listed([str(c) for c in missing])} on this node")
        l3_ok = False
    if missing := sorted(set(alloc.mb_per_cache) - set(info.mb_ids)):
        problems.append(f"MB: no MB cache id {_listed([str(c) for c in missing])} on this node")
        mb_ok = False
    # Per cache id, the level's bounds under the admin caps (what a request is checked against)
    # and the level's share (what a pod asking nothing there, or refused, gets): at least 1 %.
    l3_bounds: dict[int, tuple[int, int]] = {}
    mb_caps: dict[int, int] = {}
    for cid in info.l3_ids:
        lo, hi, _ = _level_bounds(level, cid)
        l3_bounds[cid] = (lo, min(hi, cfg.pod_l3_max_percent))
    for cid in info.mb_ids:
        mb_caps[cid] = min(_level_bounds(level, cid)[2], cfg.pod_mb_max_percent)
    l3_share = {cid: (lo, max(hi, lo + 1)) for cid, (lo, hi) in l3_bounds.items()}
    mb_share = {cid: max(cap, 1) for cid, cap in mb_caps.items()}
    for cid in info.l3_ids if info.has_l3 else ():
        lo, hi = l3_bounds[cid]
        wanted = alloc.l3_per_cache.get(cid, alloc.l3)
        if wanted is None:
            l3[cid] = l3_share[cid]
        elif wanted[0] < lo or wanted[1] > hi:
            problems.append(f"LLC: range {list(wanted)} on cache {cid} is outside the allowed "
                            f"[{lo}, {hi}]")
            l3_ok = False
        else:
            l3[cid] = wanted
    for cid in info.mb_ids if info.has_mb else ():
        cap = mb_caps[cid]
        want = alloc.mb_per_cache.get(cid, alloc.mb)
        if want is None:
            mb[cid] = mb_share[cid]
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
        l3 = l3_share
    if not mb_ok:
        mb = mb_share
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
        return PodPlan(source=source,
                       problems=(*problems, f"pod uid {bounded_repr(pod.uid)} is not a uid"))
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
