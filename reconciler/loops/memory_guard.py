"""Memory guard: cap the memory of the reclaimed (BestEffort) tier from NUMA free memory.

Per NUMA node ``n``::

    watermark(n) = max(floor, low_watermark(n) x scale_factor)
    cap          = sum over n of ( reclaimed_used(n) + max(free(n) - watermark(n), 0) )

so the offline tier may keep what it uses and grow into the free memory above each node's
watermark, never into the reserve kept for online pods. ``reclaimed_used(n)`` comes from the tier
cgroup's ``memory.numa_stat`` (v1: ``hierarchical_total`` pages; v2: ``anon`` + ``file`` bytes);
without that file the tier's whole usage is used, which gives the same sum.

The cap is written to the BestEffort QoS cgroup: ``memory.limit_in_bytes`` on v1, ``memory.max``
and ``memory.high = high_ratio x cap`` on v2. A falling cap moves at most ``max_step_bytes`` per
cycle, from the current limit and from the current usage, so the kernel reclaims gradually
instead of OOM-killing the tier at once.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import structlog

from nri_plugin.audit import AuditLog
from nri_plugin.config.schema import Config
from reconciler.cgroups import BESTEFFORT, CgroupLayout
from reconciler.loops.base import Loop
from reconciler.numa import NumaNode, read_nodes
from reconciler.sysfs import PAGE_SIZE, Outcome, SysFs, parse_bytes, same_bytes

log = structlog.get_logger("nri_qos.reconciler")

_NODE_FIELD = re.compile(r"N(\d+)=(\d+)")


def parse_numa_stat(text: str, v2: bool, page_size: int) -> dict[int, int]:
    """Bytes per node charged to a cgroup (its whole subtree), from ``memory.numa_stat``."""
    wanted = ("anon", "file") if v2 else ("hierarchical_total",)
    fallback = () if v2 else ("total",)
    found: dict[str, dict[int, int]] = {}
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        key = head.split("=", 1)[0]
        if key in wanted or key in fallback:
            found[key] = {int(n): int(v) for n, v in _NODE_FIELD.findall(rest)}
    keys = [k for k in wanted if k in found] or [k for k in fallback if k in found]
    scale = 1 if v2 else page_size
    per_node: dict[int, int] = {}
    for key in keys:
        for node, value in found[key].items():
            per_node[node] = per_node.get(node, 0) + value * scale
    return per_node


def target_cap(nodes: Sequence[NumaNode], reclaimed_used: int, floor_bytes: int,
               scale_factor: float) -> int:
    """The formula of the module doc (the per-node usage terms sum to the tier's usage)."""
    spare = sum(max(n.headroom(floor_bytes, scale_factor), 0) for n in nodes)
    return reclaimed_used + spare


def bounded_cap(target: int, previous: int | None, usage: int, step: int) -> int:
    """``target``, but falling at most ``step`` below the previous cap and below ``usage``."""
    floor = usage - step
    if previous is not None:
        floor = max(floor, previous - step)
    return max(target, floor, 0)


class MemoryGuardLoop(Loop):
    name = "memory_guard"

    def __init__(self, config: Callable[[], Config], sysfs: SysFs, layout: CgroupLayout,
                 audit: AuditLog) -> None:
        self._config = config
        self._sysfs = sysfs
        self._layout = layout
        self._audit = audit
        self._warned_missing = False

    def interval(self) -> float:
        return self._config().memory_guard.interval_s

    def cycle(self, now: float) -> None:
        cfg = self._config()
        guard = cfg.memory_guard
        if not (cfg.reconciler.enabled and guard.enabled):
            return
        page = PAGE_SIZE
        sysfs, v2 = self._sysfs, self._layout.v2
        tier = self._layout.tier_dir("memory", BESTEFFORT)
        if not sysfs.is_dir(tier):
            if not self._warned_missing:
                self._warned_missing = True
                log.warning("memory_guard_idle", reason="no BestEffort cgroup", path=tier)
            return
        self._warned_missing = False
        nodes = read_nodes(sysfs, page)
        usage = sysfs.read_int(f"{tier}/{'memory.current' if v2 else 'memory.usage_in_bytes'}")
        if not nodes or usage is None:
            return
        stat = sysfs.read(f"{tier}/memory.numa_stat")
        per_node = parse_numa_stat(stat, v2, page) if stat else {}
        reclaimed = sum(per_node.values()) if per_node else usage
        target = target_cap(nodes, reclaimed, guard.watermark_floor_bytes,
                            guard.watermark_scale_factor)
        limit_file = f"{tier}/{'memory.max' if v2 else 'memory.limit_in_bytes'}"
        current_text = sysfs.read(limit_file)
        if current_text is None:
            return
        previous = parse_bytes(current_text)
        cap = bounded_cap(target, previous, usage, guard.max_step_bytes) // page * page
        reason = (f"memory guard: reclaimed {reclaimed} B + headroom over "
                  f"{len(nodes)} NUMA node(s)")
        if v2:
            high = int(cap * guard.high_ratio) // page * page
            high_file = f"{tier}/memory.high"
            # Lower memory.high before memory.max so the tier is throttled before it is capped,
            # and raise memory.max first for the same reason.
            falling = previous is None or cap < previous
            order = [(high_file, high), (limit_file, cap)] if falling \
                else [(limit_file, cap), (high_file, high)]
            outcomes = {path: sysfs.write_if_changed(path, str(value), reason, same=same_bytes)
                        for path, value in order}
            changed = outcomes[limit_file] == Outcome.WRITTEN
        else:
            changed = sysfs.write_if_changed(limit_file, str(cap), reason,
                                             same=same_bytes) == Outcome.WRITTEN
        if changed:
            self._audit.record("memory_guard_cap", path=limit_file, cap_bytes=cap,
                               previous_bytes=previous, target_bytes=target, usage_bytes=usage)
