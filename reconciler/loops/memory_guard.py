"""Memory guard: cap the memory of the reclaimed (BestEffort) tier from NUMA free memory.

Per NUMA node ``n``::

    floor(n)     = min(watermark_floor_bytes, total(n) x watermark_floor_percent / 100)
    watermark(n) = max(floor(n), low_watermark(n) x scale_factor)
    cap          = max(minimum_cap_bytes, reserved,
                       reclaimed_used + sum over local n of max(free(n) - watermark(n), 0))
    reserved     = allocatable - memory requests of the pods outside the BestEffort tier

(the ladder's squeeze, :mod:`reconciler.loops.memory_squeeze`, may go under
``minimum_cap_bytes`` and ``reserved``, down to its own ``floor_bytes``)

so the offline tier may keep what it uses and grow into the free memory above each node's
watermark, never into the reserve kept for online pods. The local nodes have CPUs and memory
(:func:`~reconciler.host.numa.local_nodes`): far memory's free pages are no room for the tier, as
it fills local memory first and the kernel demotes into far memory on its own. ``reclaimed_used``
sums the tier's ``memory.numa_stat`` over every node (v1: ``hierarchical_total`` pages; v2:
``anon`` + ``file``), else its usage. The floor is at most a share of each node's memory, so a
node of a few GiB keeps room for the tier, and the cap is never under ``minimum_cap_bytes``: a
cap of zero (an empty tier, no headroom) OOM-kills every pod of the tier, new ones at once.

``reserved`` is kubelet's own cap with ``--qos-reserved=memory=100%`` (``allocatable``: the
``kubepods`` limit, else ``MemTotal``), applied with ``floor_from_requests``. Free memory alone
is a poor measure of what online pods need: page cache fills it as a matter of course, and a cap
following it had the tier reclaim its own pages all the time, on the online pods' CPUs (on a v2
node of 4 GiB the online p99 rose from 6.3 ms under kubelet's static cap to 9.2 ms,
``docs/effectiveness.md``). Below ``reserved`` the tier goes only when the ladder squeezes it.

When the NUMA nodes' ``MemTotal`` does not add up to ``/proc/meminfo``'s (hot-added or ballooned
memory, see :mod:`reconciler.host.numa`), per-node free memory is not the machine's: the cap is
then computed for the machine as one node (free and total from ``/proc/meminfo`` less the
memory-only nodes', the local zones' low watermarks summed, the floor once per local node),
and ``numa_view_inconsistent`` is audited once with both figures.

The cap is written to the BestEffort QoS cgroup: ``memory.limit_in_bytes`` on v1, ``memory.max``
and ``memory.high = max(high_ratio x cap, reserved)`` on v2 (at most the cap). A falling cap
moves at most ``max_step_bytes`` per cycle, from the current limit and from the current usage,
so the kernel reclaims gradually instead of OOM-killing the tier at once.

That cap is the guard's *standing* cap, held whether or not anything presses the online pods.
``standing_cap`` says where it applies: ``cgroup-v1`` (the default), ``always`` or ``never``. On
v2 the online levels' ``memory.low`` has the kernel reclaim the unprotected tier first, at
``kubepods``' limit as in the machine's, so the cap only kept the tier out of memory nobody
used: on a 4 GiB v2 node it cost two offline pods 17-27 % of their work and bought the online
pod nothing measurable (``docs/effectiveness.md``). v1 has no ``memory.low``; there the cap
is the one thing that keeps the tier off the online pods' pages. Without a standing cap the
guard writes the ladder's squeeze alone (:mod:`reconciler.loops.memory_squeeze`): v2
``memory.high`` (``memory.max`` left as it was), v1 the limit (the tier's OOM killer off
meanwhile), and when the squeeze ends the tier's files get back what they had before.

Before its first write to a tier file the guard notes the file's value in the state file
(:mod:`reconciler.host.statefile`), and writes it back when the guard goes away: switched off by
a reload (``memory_guard.enabled`` or ``reconciler.enabled``), the agent stopping, or ``nri-qos
reset``. A cap or squeeze left as last written would otherwise hold the offline tier to a figure
computed from memory that nobody watches any more.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from common.audit import AuditLog
from hooks.config_fields import setting
from reconciler.host.cgroups import BESTEFFORT, GUARANTEED, CgroupLayout
from reconciler.host.memstat import anon_bytes
from reconciler.host.numa import (
    MEMINFO,
    NumaNode,
    check_view,
    local_nodes,
    meminfo_values,
    read_nodes,
    system_node,
)
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.host.values import PAGE_SIZE, UNLIMITED_THRESHOLD, parse_bytes, same_bytes
from reconciler.host.watermarks import Watermarks
from reconciler.loops.base import Loop, ReconcilerConfig
from reconciler.loops.memory_squeeze import (
    OOM_CONTROL,
    PAUSED_RECHECK_S,
    GuardSqueeze,
    KillHold,
    Squeeze,
    held,
    restore_file,
    squeezed,
)
from reconciler.metrics import ReconcilerMetrics

log = structlog.get_logger("nri_qos.reconciler")


STANDING_CAP = ("always", "cgroup-v1", "never")
NO_USAGE = ("the BestEffort cgroup has no memory usage file: the memory controller is not "
            "enabled in its parents' cgroup.subtree_control (cgroup v2)")


@dataclass(frozen=True, slots=True)
class MemoryGuardConfig:
    enabled: bool = setting(True, "Cap the memory of the reclaimed (BestEffort) tier: a "
                            "standing cap where standing_cap says so, and the mitigation "
                            "ladder's squeeze.")
    standing_cap: str = setting(
        "cgroup-v1", "Where the guard caps the tier outside the ladder's squeeze: always, on "
        "cgroup v1 only, or never. On v2 the online levels' memory.low (memory.levels.*."
        "low_ratio) has the kernel reclaim the unprotected tier first, at kubepods' limit as "
        "in the machine's reclaim; a standing cap there held the offline pods below memory "
        "nobody used and bought the online pod nothing measurable. v1 has no memory.low.",
        choices=STANDING_CAP)
    interval_s: float = setting(5.0, "Period of the guard loop.", unit="seconds",
                                minimum=0.1, maximum=3600)
    watermark_floor_bytes: int = setting(
        4 << 30, "Lowest per-NUMA-node watermark kept free for online pods (at most "
        "watermark_floor_percent of the node's memory).", unit="bytes",
        minimum=0, maximum=1 << 50,
    )
    watermark_floor_percent: float = setting(
        10.0, "The floor of a NUMA node is at most this share of its memory: a 4 GiB floor on "
        "a node of 2-4 GiB per NUMA node would keep all of it from the offline tier. 4 GiB "
        "applies from 40 GiB per NUMA node up.", unit="percent", minimum=0, maximum=100,
    )
    minimum_cap_bytes: int = setting(
        512 << 20, "The cap never goes below this, whatever the nodes' free memory: a cap of "
        "zero OOM-kills every pod of the tier, new ones at their first allocation. Enough "
        "for a few offline pods to start; cgroup v2's memory.high is high_ratio of it.",
        unit="bytes", minimum=16 << 20, maximum=1 << 50,
    )
    watermark_scale_factor: float = setting(
        1.0, "Multiplier of the kernel low watermark.", minimum=0.0, maximum=100.0
    )
    max_step_bytes: int = setting(
        1 << 30, "Largest decrease of the cap in one cycle (no OOM cliff).", unit="bytes",
        minimum=1 << 20, maximum=1 << 50,
    )
    floor_from_requests: bool = setting(
        True, "The cap never goes below allocatable (the kubepods cgroup's limit, else the "
        "machine's memory) minus the memory requests of the pods outside the BestEffort tier, "
        "the cap of kubelet's --qos-reserved=memory=100%: the tier is held below what online "
        "pods asked for only while the ladder squeezes it.")
    high_ratio: float = setting(
        0.95, "cgroup v2: memory.high = high_ratio x memory.max.", minimum=0.5, maximum=1.0
    )
    numa_view_tolerance_percent: float = setting(
        10.0, "When the NUMA nodes' MemTotal differs from /proc/meminfo's by more than this, "
        "node-wide figures come from /proc/meminfo (hot-added or ballooned memory). Read at "
        "start.",
        unit="percent", minimum=0, maximum=100,
    )

    def standing(self, v2: bool) -> bool:
        """Whether the guard holds a standing cap on a node of this cgroup version."""
        return self.standing_cap == "always" or (self.standing_cap == "cgroup-v1" and not v2)


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
               scale_factor: float, floor_percent: float | None = None) -> int:
    """The formula of the module doc (the per-node usage terms sum to the tier's usage)."""
    spare = sum(max(n.headroom(floor_bytes, scale_factor, floor_percent), 0) for n in nodes)
    return reclaimed_used + spare


def reserved_cap(allocatable: int, requests: int) -> int:
    """kubelet's QOSReserved cap of the BestEffort tier: what the other pods did not request."""
    return max(allocatable - requests, 0)


def bounded_cap(target: int, previous: int | None, usage: int, step: int) -> int:
    """``target``, but falling at most ``step`` below the previous cap and below ``usage``."""
    floor = usage - step
    if previous is not None:
        floor = max(floor, previous - step)
    return max(target, floor, 0)


class MemoryGuardSections(Protocol):
    """The sections the memory guard reads."""

    @property
    def reconciler(self) -> ReconcilerConfig: ...

    @property
    def memory_guard(self) -> MemoryGuardConfig: ...


NOTES = "memory_guard"
"""The state file's section: tier file -> its value before the guard first wrote it."""


def restore_tier(sysfs: SysFs, notes: StateFile, reason: str) -> list[tuple[str, str]]:
    """Writes back every tier file the guard changed (the limit first, so the tier is never
    capped below its throttle, and a v1 tier waiting at its squeezed limit is let go before
    its OOM killer is back), forgetting each one restored or gone; the (path, value) pairs
    written or already so. A tier whose limit the kernel refused keeps its OOM killer off and
    its note: a task waiting at the limit would be killed for a limit that was not raised."""
    restored = []
    entries = notes.entries(NOTES)
    refused: set[str] = set()  # tiers whose limit is still the guard's
    for path in sorted(entries, key=_restore_rank):
        tier, _, name = path.rpartition("/")
        if name == OOM_CONTROL and tier in refused:
            continue
        outcome = restore_file(sysfs, notes, NOTES, path, reason)
        if outcome in (Outcome.WRITTEN, Outcome.UNCHANGED):
            restored.append((path, entries[path]))
        elif outcome is Outcome.FAILED and _restore_rank(path) == 0:
            refused.add(tier)
    return restored


def _restore_rank(path: str) -> int:
    if path.endswith(("/memory.max", "/memory.limit_in_bytes")):
        return 0
    return 2 if path.endswith(f"/{OOM_CONTROL}") else 1


class MemoryGuardLoop(Loop):
    name = "memory_guard"

    def __init__(self, config: Callable[[], MemoryGuardSections], sysfs: SysFs,
                 layout: CgroupLayout, audit: AuditLog,
                 squeeze: GuardSqueeze | None = None, metrics: ReconcilerMetrics | None = None,
                 notes: StateFile | None = None,
                 requests: Callable[[], int] | None = None,
                 watermarks: Watermarks | None = None) -> None:
        """``watermarks``: the zones' low watermarks as the agent's loops share them (None:
        this loop's own)."""
        self._watermarks = watermarks if watermarks is not None else Watermarks(sysfs)
        # The memory requested by the pods outside the BestEffort tier (None: not known, no
        # floor from requests).
        self._requests = requests
        self._notes = notes if notes is not None else StateFile(None)
        self._was_held = False
        self._config = config
        self._metrics = metrics
        self._sysfs = sysfs
        self._layout = layout
        self._audit = audit
        self._squeeze = squeeze
        self._warned_missing = False
        self._numa_consistent = True
        # (tightening, tight limit) of the squeeze being held; None when not squeezed.
        self._held: tuple[int, int] | None = None
        # The ladder's ask as the last cycle saw it.
        self._seen: int | None = None
        # cgroup v1: the tier's OOM killer, off for a squeeze (memory_squeeze's module doc).
        self._kills = KillHold(sysfs, self._notes, NOTES)

    def subscribe_wake(self, wake: Callable[[], None]) -> Callable[[], None]:
        """A squeeze set or released wakes the guard."""
        if self._squeeze is None:
            return super().subscribe_wake(wake)
        return self._squeeze.subscribe(wake)

    def interval(self) -> float:
        period = self._config().memory_guard.interval_s
        # A task of the tier may be waiting at the squeezed limit for the next raise.
        return min(period, PAUSED_RECHECK_S) if self._kills.off else period

    def wake_gap(self) -> float:
        """0 when the ladder's squeeze changed since the last cycle began: its ask is urgent (the
        node is reclaiming from online pods now), unlike a burst of container churn. The
        usual gap made the squeeze that follows a release wait up to half a second."""
        if self._asked() != self._seen:
            return 0.0
        return super().wake_gap()

    def _asked(self) -> int | None:
        """The ladder's current ask (its tightening number; None: not squeezed)."""
        squeeze = self._squeeze.current() if self._squeeze is not None else None
        return None if squeeze is None else squeeze.tightening

    def cycle(self, now: float) -> None:
        self._seen = self._asked()
        cfg = self._config()
        guard = cfg.memory_guard
        if not (cfg.reconciler.enabled and guard.enabled):
            self._restore("memory guard switched off")
            return
        held = self._sysfs.held()
        if held and not self._was_held:
            # Observe: the node is watched, not acted on; the cap an enforcing run left goes
            # back (the guard goes on deciding, its writes held and audited).
            self._restore("observe mode: the node is watched, not acted on")
        self._was_held = held
        page = PAGE_SIZE
        sysfs, v2 = self._sysfs, self._layout.v2
        tier = self._layout.tier_dir("memory", BESTEFFORT)
        usage = sysfs.read_int(f"{tier}/{'memory.current' if v2 else 'memory.usage_in_bytes'}")
        if usage is None:
            if not self._warned_missing:
                self._warned_missing = True
                log.warning("memory_guard_idle", path=tier, reason=NO_USAGE if sysfs.is_dir(tier)
                            else "no BestEffort cgroup")
            return
        self._warned_missing = False
        squeeze = self._squeeze.current() if self._squeeze is not None else None
        if squeeze is None:
            self._held = None
        standing = guard.standing(v2)
        if squeeze is None and not standing:
            # Nothing to compute: the node's memory is read only for a cap or a squeeze.
            self._restore(f"no squeeze and no standing cap on cgroup v{2 if v2 else 1} "
                          f"(memory_guard.standing_cap = {guard.standing_cap})")
            if self._metrics is not None:
                self._metrics.memory_guard(None, usage)
            return
        meminfo = sysfs.read(MEMINFO)
        marks = self._watermarks.at(now)
        nodes = read_nodes(sysfs, page, meminfo, lows=marks.node_lows(), far=marks.far)
        if not nodes:
            return
        stat = sysfs.read(f"{tier}/memory.numa_stat")
        per_node = parse_numa_stat(stat, v2, page) if stat else {}
        reclaimed = sum(per_node.values()) if per_node else usage
        view_nodes, floor = self._node_view(nodes, meminfo_values(meminfo), guard)
        target = target_cap(view_nodes, reclaimed, floor, guard.watermark_scale_factor,
                            guard.watermark_floor_percent)
        reserved = self._reserved(meminfo) if guard.floor_from_requests and standing else None
        limit_file = f"{tier}/{self._layout.limit_file}"
        current_text = sysfs.read(limit_file)
        if current_text is None:
            return
        previous = parse_bytes(current_text)
        # Anonymous memory counts 0 when memory.stat is unreadable (the floor still holds) or
        # a v2 squeeze need not spare it.
        spare = squeeze is not None and (squeeze.spare_anonymous or not v2)
        anonymous = (anon_bytes(sysfs.read(f"{tier}/memory.stat") or "", v2) or 0) if spare else 0
        tight = None if squeeze is None else self._tight(usage, anonymous, squeeze)
        if tight is not None and not v2 and not self._kills.hold(tier):
            tight = None
        if standing:
            # The minimum bounds the guard's own cap; a squeeze has its own floor (floor_bytes).
            cap = max(bounded_cap(target, previous, usage, guard.max_step_bytes),
                      guard.minimum_cap_bytes, reserved or 0)
        else:
            # Squeezed, with no cap of the guard's own: the limit the tier had before the guard.
            before = parse_bytes(self._notes.entries(NOTES).get(limit_file, current_text))
            cap = UNLIMITED_THRESHOLD if before is None else before
        if tight is not None and not v2:
            # At once, not one step per cycle from the previous cap: only the usage bound (no
            # OOM cliff) still holds.
            cap = max(min(cap, tight), usage - guard.max_step_bytes)
        cap = cap // page * page
        where = "the machine" if view_nodes[0].id < 0 else f"{len(view_nodes)} NUMA node(s)"
        reason = f"memory guard: reclaimed {reclaimed} B + headroom over {where}"
        if reserved is not None and cap == reserved:
            reason = f"memory guard: allocatable - requests of the other pods ({reserved} B)"
        if not standing:
            reason = "memory guard: no standing cap"
        capped = cap if cap < UNLIMITED_THRESHOLD else None
        limit_text = self._layout.unlimited if capped is None else str(cap)
        if squeeze is not None and tight is not None:
            reason += f"; squeezed to {tight} B ({squeeze.reason})"
        if v2:
            high = int(cap * guard.high_ratio) // page * page
            if reserved is not None:
                # Not throttled below what kubelet's own cap would leave it either.
                high = max(high, min(reserved, cap))
            if tight is not None:
                high = min(high, tight)
            high_file = f"{tier}/memory.high"
            # Lower memory.high before memory.max so the tier is throttled before it is capped,
            # and raise memory.max first for the same reason.
            falling = previous is None or cap < previous
            order = [(high_file, str(high)), (limit_file, limit_text)] if falling \
                else [(limit_file, limit_text), (high_file, str(high))]
            if not self._noted((high_file, limit_file), current_text):
                return
            outcomes = {path: sysfs.write_if_changed(path, text, reason, same=same_bytes)
                        for path, text in order}
            limit_outcome = outcomes[limit_file]
            # A cap is recorded once both files hold it: memory.high written beside a refused
            # memory.max is not the cap (the failed write has its own record).
            applied = all(o in (Outcome.WRITTEN, Outcome.UNCHANGED) for o in outcomes.values())
            changed = applied and Outcome.WRITTEN in outcomes.values()
            extra = {"high_bytes": high}
        else:
            if not self._noted((limit_file,), current_text):
                return
            limit_outcome = sysfs.write_if_changed(limit_file, limit_text, reason, same=same_bytes)
            changed = limit_outcome == Outcome.WRITTEN
            extra = {}
            if tight is None and limit_outcome in (Outcome.WRITTEN, Outcome.UNCHANGED):
                self._kills.give_back(tier, "memory guard: the squeeze ended")
        if self._metrics is not None and limit_outcome in (Outcome.WRITTEN, Outcome.UNCHANGED):
            self._metrics.memory_guard(capped, usage)
        if changed:
            self._audit.record("memory_guard_cap", path=limit_file, cap_bytes=capped,
                               previous_bytes=previous, target_bytes=target,
                               reserved_bytes=reserved, usage_bytes=usage,
                               squeezed=tight is not None, **extra)

    def _reserved(self, meminfo: str | None) -> int | None:
        """kubelet's QOSReserved cap (:func:`reserved_cap`); None where the requests are not
        known or neither the kubepods limit nor the machine's memory can be read."""
        if self._requests is None:
            return None
        kubepods = self._layout.tier_dir("memory", GUARANTEED)
        text = self._sysfs.read(f"{kubepods}/{self._layout.limit_file}")
        try:
            allocatable = parse_bytes(text) if text is not None else None
        except ValueError:
            allocatable = None
        if allocatable is None:
            allocatable = meminfo_values(meminfo).get("MemTotal")
        if not allocatable:
            return None
        return reserved_cap(allocatable, self._requests()) // PAGE_SIZE * PAGE_SIZE

    def _noted(self, paths: Sequence[str], limit_text: str) -> bool:
        """Notes each file's value before the guard's first write to it; False (nothing is
        written) when the state file refuses a note."""
        notes = self._notes.entries(NOTES)
        for path in paths:
            if path in notes:
                continue
            value = limit_text if path.endswith(("/memory.max", "/memory.limit_in_bytes")) \
                else self._sysfs.read(path)
            if value is None or not self._notes.remember(NOTES, path, value.strip()):
                return False
        return True

    def _restore(self, reason: str) -> None:
        self._held = None
        self._kills.off = False
        if not self._notes.entries(NOTES):
            return
        restored = restore_tier(self._sysfs, self._notes, reason)
        if restored:
            log.info("memory_guard_restored", reason=reason,
                     files={path: value for path, value in restored})

    def close(self) -> None:
        """The agent stops: the tier gets back what it had before the guard."""
        self._restore("agent stopping")

    def _tight(self, usage: int, anonymous: int, squeeze: Squeeze) -> int:
        """A step below the usage on the first ask, a step below the limit held on a later one,
        else the limit held (see the module doc)."""
        if self._held is None:
            tight = squeezed(usage, anonymous, squeeze)
        elif self._held[0] != squeeze.tightening:
            # From the limit held, not from the usage: a job that has just freed its buffers
            # would otherwise be held below what it takes again a moment later.
            tight = squeezed(self._held[1], anonymous, squeeze)
        else:
            tight = held(self._held[1], anonymous, squeeze)
        self._held = (squeeze.tightening, tight)
        return tight

    def _node_view(self, nodes: list[NumaNode], meminfo: dict[str, int],
                   guard: MemoryGuardConfig) -> tuple[list[NumaNode], int]:
        """The nodes the cap is computed over and the floor per node: the local NUMA nodes, or
        the machine as one node when their totals do not add up (audited when that starts)."""
        view = check_view(nodes, meminfo.get("MemTotal", 0), guard.numa_view_tolerance_percent)
        consistent = view.consistent or not meminfo
        if consistent != self._numa_consistent:
            self._numa_consistent = consistent
            if consistent:
                log.info("numa_view_consistent", nodes_total_bytes=view.nodes_total_bytes,
                         system_total_bytes=view.system_total_bytes)
            else:
                self._audit.record("numa_view_inconsistent",
                                   nodes_total_bytes=view.nodes_total_bytes,
                                   system_total_bytes=view.system_total_bytes,
                                   tolerance_percent=guard.numa_view_tolerance_percent)
        local = local_nodes(nodes)
        if consistent:
            return local, guard.watermark_floor_bytes
        return [system_node(meminfo, nodes)], guard.watermark_floor_bytes * len(local)
