"""NUMA balance: move reclaimed pods' memory off a node under its watermark, in bounded steps.

Binding (:mod:`reconciler.loops.numa_binding`) decides where reclaimed pods may allocate; it
does not move what they already hold. On cgroup v2 a ``cpuset.mems`` write that takes a node
away migrates every page the cgroup's processes hold there, synchronously and in one go (seen
in a two-node guest: 772 MiB in 2.2 s, 1.6 GiB in 8 s, the writer blocked throughout), an
unbounded step that nothing can interrupt. This loop moves the pages instead, in steps:

1. the pure planner (:func:`plan_step`) picks the node furthest under its watermark (hot), the
   node with most headroom (cool), and the ``reclaimed_cores`` container holding most on the hot
   node (its pod first: largest pod, then its largest container, by ``memory.numa_stat``);
   a step asks for ``min(step_bytes, the container's bytes on hot, headroom(cool) / 2)``, so the
   cool node never falls below its own watermark nor becomes the next hot node (none while
   ``headroom(cool) / 2`` is under ``min_step_bytes``: both nodes are then short, which moving
   pages between them does not mend), and waits for
   the rate limit: a step that moved ``b`` bytes and ended at ``t`` lets the next start at
   ``t + b / rate_bytes_per_s``;
2. the container's ``cpuset.mems`` gets the cool node added (widening moves nothing; the
   kernel refuses to move pages onto a node outside a process's cpuset);
3. a child process moves at most the asked bytes of the container's processes (those in the
   cgroups it made below its own too, where cgroup v2 puts all of them: :func:`subtree_ids`)
   with move_pages(2), and is killed at ``step_deadline_s``
   (:meth:`~reconciler.host.sysfs.SysFs.move_pages_bounded`);
4. once a step finds less to move than it asked for, the processes hold no more there: the hot
   node is taken out of the container's ``cpuset.mems`` so new allocations stay off it (what
   moves with that write is what was allocated since the last step).

Only nodes with CPUs and memory are hot or cool (:func:`~reconciler.host.numa.local_nodes`): a
node of memory alone (far memory, HBM, a GPU's) is under its watermark as the kernel demotes cold
pages into it, and emptying it into local memory would undo that; filling it is not the
offline tier's either. A host with one local node has nothing to balance.

No step while no node is under its watermark, so balancing stops when the hot node recovers. A
container whose step failed (the kernel refused the wider ``cpuset.mems`` or the move) is left
out for :data:`REFUSED_PAUSE_S`.
Online pods are never touched. Each step is audited (``numa_balance_step``: bytes asked, bytes
moved by ``memory.numa_stat`` before and after, duration) and counted. The ``cpuset.mems``
values from before are noted in the state file (unless the binding noted them first), and written
back when the balance is switched off and by ``nri-qos reset``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from common.audit import AuditLog
from common.state import NodeState
from hooks.config_fields import setting
from hooks.levels import QosLevel
from reconciler.host.cgroups import CgroupLayout, subtree_ids
from reconciler.host.held_writes import HeldWrites
from reconciler.host.numa import NumaNode, local_nodes, node_ids, read_nodes
from reconciler.host.parse import errno_text
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.host.values import PAGE_SIZE, format_id_list, parse_id_list
from reconciler.host.watermarks import Watermarks
from reconciler.loops.base import Loop, ReconcilerConfig
from reconciler.loops.common import Managed, ManagedCache
from reconciler.loops.memory_guard import MemoryGuardConfig, parse_numa_stat
from reconciler.loops.numa_binding import (
    NUMA_BALANCE_NOTES,
    effective_mems,
    release_unreclaimed,
    restore_bindings,
    undo_noted,
)
from reconciler.metrics import ReconcilerMetrics

log = structlog.get_logger("nri_qos.reconciler")

MIB = 1 << 20
MIN_GAP_S = 0.05
"""The shortest wait between two cycles while a step waits for the rate limit."""
REFUSED_PAUSE_S = 60.0
"""How long a container whose step failed is left out: the kernel would refuse it again at
once (a node its parent's cpuset does not allow, a move refused), and every try is audited."""
RESIDUE_BYTES = 1 << 20
"""What may stay on the hot node when a step is done: pages counted in ``memory.numa_stat`` that
move_pages reports moved but that do not move (seen in a guest: 48 KiB, step after step), so the
node is taken out of ``cpuset.mems`` once no more than this is left (the write moves what it can
of it, at once: at most this much)."""
NOTHING_TO_BALANCE_RECHECK_S = 60.0
"""On cgroup v1, or with fewer than two local NUMA nodes, there is nothing to balance: the loop
looks again this often (memory brought online may add a node) instead of every second."""


@dataclass(frozen=True, slots=True)
class NumaBalanceConfig:
    enabled: bool = setting(
        True, "Move reclaimed pods' memory off a NUMA node under its watermark onto the node "
        "with most headroom, in bounded steps (cgroup v2).")
    interval_s: float = setting(1.0, "Period of the balancing loop while it moves memory: a "
                                "NUMA node under its watermark, another with room for a step "
                                "and a reclaimed pod on the first (once a minute where there "
                                "is nothing to balance: cgroup v1, one NUMA node).",
                                unit="seconds",
                                minimum=0.1, maximum=3600)
    quiet_interval_s: float = setting(
        5.0, "Period while there is no step to take (never shorter than interval_s): no NUMA "
        "node under its watermark, none with room for a step (every node short, as on a busy "
        "node whose page cache fills its memory), no reclaimed pod on the node under it, or no "
        "reclaimed container at all. The nodes' memory is not read every second for nothing; "
        "a node that falls under its watermark starts moving within this; sudden pressure is "
        "detection's and the ladder's to answer, and steps are rate-limited anyway.",
        unit="seconds", minimum=0.1, maximum=3600)
    step_bytes: int = setting(
        64 * MIB, "Most memory one step moves.", unit="bytes", minimum=PAGE_SIZE,
        maximum=1 << 40)
    min_step_bytes: int = setting(
        16 * MIB, "No step while half the cool node's headroom is under this: both nodes are "
        "then short of memory, and steps that shrink by half each time only cost a page walk "
        "(a container's last bytes on the hot node still move, however few).", unit="bytes",
        minimum=PAGE_SIZE, maximum=1 << 40)
    step_deadline_s: float = setting(
        5.0, "A step still running after this is killed; what it moved stays moved.",
        unit="seconds", minimum=0.1, maximum=600)
    rate_bytes_per_s: int = setting(
        128 * MIB, "Most memory moved per second over consecutive steps (bytes per second).",
        unit="bytes", minimum=MIB, maximum=1 << 40)
    dry_run: bool = setting(
        False, "Decide and audit each step, move nothing and change no cpuset.mems.")

    def validate(self) -> list[tuple[str, str]]:
        if self.min_step_bytes > self.step_bytes:
            return [("min_step_bytes", "must be <= step_bytes")]
        return []


class NumaBalanceSections(Protocol):
    """The sections the balancing loop reads (the guard's watermark decides hot and cool)."""

    @property
    def reconciler(self) -> ReconcilerConfig: ...

    @property
    def numa_balance(self) -> NumaBalanceConfig: ...

    @property
    def memory_guard(self) -> MemoryGuardConfig: ...


@dataclass(frozen=True, slots=True)
class Candidate:
    """A container with its pod, level and bytes per NUMA node (``memory.numa_stat``)."""

    pod_uid: str
    container: str
    level: str
    per_node: Mapping[int, int]
    mems: frozenset[int]
    """The nodes its cpuset has in effect: one it may not use holds only what no step can move."""
    reach: frozenset[int] | None = None
    """The nodes its parent's cpuset has in effect (None: not known), the only ones its pages
    may go to: the kernel refuses a move anywhere else (EACCES), and on v2 a ``cpuset.mems``
    naming another node is taken but leaves it out of effect."""


@dataclass(frozen=True, slots=True)
class Step:
    candidate: Candidate
    hot: int
    cool: int
    asked_bytes: int


@dataclass(frozen=True, slots=True)
class Decision:
    """The step to take now, or None and why not (``retry_at``: when the rate limit lets the
    step that waits for it start)."""

    step: Step | None
    reason: str
    retry_at: float | None = None


@dataclass(frozen=True, slots=True)
class Watermark:
    """The memory guard's watermark settings (:meth:`NumaNode.watermark`)."""

    floor_bytes: int
    scale_factor: float
    floor_percent: float | None


def next_step_at(last_end: float, last_moved_bytes: int, rate_bytes_per_s: int) -> float:
    """When the rate limit lets the next step start."""
    return last_end + last_moved_bytes / rate_bytes_per_s


def plan_step(nodes: Sequence[NumaNode], candidates: Callable[[], Sequence[Candidate]],
              mark: Watermark, *, step_bytes: int, rate_bytes_per_s: int,
              last: tuple[float, int] | None, now: float, min_step_bytes: int) -> Decision:
    """The next step: from the node furthest under its watermark to the node with most
    headroom, the largest reclaimed pod's largest container first; ``last`` is the previous
    step's end time and bytes moved (None: none yet). ``candidates`` is called only when a node
    is under its watermark and another has headroom: reading every reclaimed container's
    ``memory.numa_stat`` each second costs more than everything else the loop does, and on a
    node nothing presses it would be read for nothing."""
    room = {n.id: n.headroom(mark.floor_bytes, mark.scale_factor, mark.floor_percent)
            for n in nodes}
    hot_nodes = sorted((r, n) for n, r in room.items() if r < 0)
    if not hot_nodes:
        return Decision(None, "no NUMA node is under its watermark")
    cool = max(room, key=lambda n: (room[n], -n))
    if room[cool] <= 0:
        return Decision(None, "no NUMA node has headroom")
    # Half the cool node's headroom at most: pages moved there must not make it the next hot
    # node (allocations elsewhere keep taking from it) and send them back.
    budget = min(step_bytes, room[cool] // 2)
    offline = [c for c in candidates() if c.level == QosLevel.RECLAIMED_CORES]
    for _, hot in hot_nodes:
        holding = [c for c in offline if c.per_node.get(hot, 0) > 0 and hot in c.mems
                   and (c.reach is None or cool in c.reach)]
        if not holding:
            continue
        pod_bytes: dict[str, int] = {}
        for c in holding:
            pod_bytes[c.pod_uid] = pod_bytes.get(c.pod_uid, 0) + c.per_node[hot]
        chosen = min(holding, key=lambda c: (-pod_bytes[c.pod_uid], -c.per_node[hot],
                                             c.pod_uid, c.container))
        if last is not None:
            start = next_step_at(last[0], last[1], rate_bytes_per_s)
            if now < start:
                return Decision(None, f"rate limit: next step in {start - now:.3f} s", start)
        asked = min(budget, chosen.per_node[hot])
        if budget < min_step_bytes and asked < chosen.per_node[hot]:
            return Decision(None, f"node {cool} has {room[cool]} bytes above its watermark: "
                                  f"half of it is under a step of {min_step_bytes} bytes")
        return Decision(Step(chosen, hot, cool, asked),
                        f"node {hot} {-room[hot]} bytes under its watermark, node {cool} "
                        f"{room[cool]} bytes above")
    return Decision(None, "no reclaimed pod holds memory on the nodes under their watermark")


Mover = Callable[[Sequence[int], int, int, int, float], tuple[Outcome, int, str]]
"""Moves at most a budget of bytes of processes' pages from one node to another under a
deadline: :meth:`SysFs.move_pages_bounded`'s signature."""


class NumaBalanceLoop(Loop):
    name = "numa_balance"

    def __init__(self, config: Callable[[], NumaBalanceSections], state: NodeState,
                 sysfs: SysFs, layout: CgroupLayout, audit: AuditLog, *,
                 managed: ManagedCache | None = None, notes: StateFile | None = None,
                 metrics: ReconcilerMetrics | None = None, mover: Mover | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 watermarks: Watermarks | None = None) -> None:
        """``watermarks``: the zones' low watermarks as the agent's loops share them (None:
        this loop's own)."""
        self._watermarks = watermarks if watermarks is not None else Watermarks(sysfs)
        self._config = config
        self._state = state
        self._sysfs = sysfs
        self._layout = layout
        self._audit = audit
        self._managed = ManagedCache() if managed is None else managed
        self._notes = notes if notes is not None else StateFile(None)
        self._metrics = metrics
        self._move = mover if mover is not None else sysfs.move_pages_bounded
        self._clock = clock
        self._last: tuple[float, int] | None = None
        self._said = ""
        self._held: tuple[object, ...] = ()
        self._retry_at: float | None = None
        self._paused: dict[str, float] = {}
        self._unreadable = HeldWrites()  # container memcg -> why its files were not read
        self._nothing_to_balance = False
        self._quiet = False
        self._was_held = False

    def interval(self) -> float:
        balance = self._config().numa_balance
        period = balance.interval_s
        if self._nothing_to_balance:
            return max(period, NOTHING_TO_BALANCE_RECHECK_S)
        if self._retry_at is None:
            return max(period, balance.quiet_interval_s) if self._quiet else period
        # A step waits for the rate limit: the next cycle comes when it may start, so the rate
        # and not the period bounds how fast a hot node is relieved.
        return min(period, max(self._retry_at - self._clock(), MIN_GAP_S))

    def cycle(self, now: float) -> None:
        cfg = self._config()
        balance = cfg.numa_balance
        self._nothing_to_balance = not self._layout.v2
        self._quiet = False
        if not (cfg.reconciler.enabled and balance.enabled and self._layout.v2):
            if self._notes.entries(NUMA_BALANCE_NOTES):
                restore_bindings(self._sysfs, self._notes, "NUMA balance switched off",
                                 NUMA_BALANCE_NOTES)
            self._last = None
            return
        held = self._sysfs.held()
        if held and not self._was_held and self._notes.entries(NUMA_BALANCE_NOTES):
            # Observe: what an enforcing run changed goes back, as the binding's does.
            restore_bindings(self._sysfs, self._notes,
                             "observe mode: the node is watched, not acted on",
                             NUMA_BALANCE_NOTES)
            self._last = None
        self._was_held = held
        for path in self._notes.entries(NUMA_BALANCE_NOTES):
            if not self._sysfs.exists(path):
                self._notes.forget(NUMA_BALANCE_NOTES, path)
        managed = self._managed.get(self._state.snapshot())
        release_unreclaimed(managed, self._sysfs, self._layout, self._notes,
                            NUMA_BALANCE_NOTES)
        ids = node_ids(self._sysfs)
        if len(ids) < 2:
            self._nothing_to_balance = True
            return
        clock = self._clock()
        self._paused = {c: until for c, until in self._paused.items() if until > clock}
        items = {item.view.info.id: item for item in managed
                 if item.level == QosLevel.RECLAIMED_CORES
                 and item.view.info.id not in self._paused}
        if not items:
            # Only reclaimed pods' memory ever moves: without one, the nodes' memory (zoneinfo
            # and each node's meminfo, read every second) would decide nothing.
            self._quiet = True
            self._idle(None, "no reclaimed container to move")
            return
        marks = self._watermarks.at(now)
        nodes = local_nodes(read_nodes(self._sysfs, PAGE_SIZE, ids=ids, lows=marks.node_lows(),
                                       far=marks.far))
        if len(nodes) < 2:
            self._nothing_to_balance = True
            return

        def candidates() -> list[Candidate]:
            return [c for item in items.values() if (c := self._candidate(item)) is not None]

        guard = cfg.memory_guard
        decision = plan_step(
            nodes, candidates, Watermark(guard.watermark_floor_bytes,
                                         guard.watermark_scale_factor,
                                         guard.watermark_floor_percent),
            step_bytes=balance.step_bytes, rate_bytes_per_s=balance.rate_bytes_per_s,
            last=self._last, now=clock, min_step_bytes=balance.min_step_bytes)
        if decision.step is None:
            # No step, and none waiting for the rate limit: what would allow one (room on
            # another node, a reclaimed pod on the hot one) comes slowly or is the ladder's to
            # make. Every node short is a busy node's usual state (its page cache fills its
            # memory): looking every second read the nodes' memory each second for nothing.
            self._quiet = decision.retry_at is None
            self._idle(decision.retry_at, decision.reason)
            return
        self._retry_at = decision.retry_at
        self._said = ""
        step = decision.step
        self._take(step, items[step.candidate.container], balance, decision.reason)

    def _idle(self, retry_at: float | None, reason: str) -> None:
        """No step this cycle; ``reason`` logged once while it stays the same."""
        self._retry_at = retry_at
        if reason != self._said:
            log.debug("numa_balance_idle", reason=reason)
            self._said = reason
        self._held = ()

    def _candidate(self, item: Managed) -> Candidate | None:
        memory = self._layout.dir("memory", item.ref.rel)
        try:
            text = self._sysfs.read(f"{memory}/memory.numa_stat")
            cpuset = self._layout.dir("cpuset", item.ref.rel)
            mems = self._allowed(cpuset)
            reach = effective_mems(self._sysfs, cpuset.rsplit("/", 1)[0])
        except OSError as exc:
            # That container's alone, said once while it lasts: the others may still move.
            error = errno_text(exc)
            if self._unreadable.news(memory, error):
                log.warning("numa_balance_unreadable", container=item.view.info.name,
                            error=error)
            return None
        self._unreadable.forget(memory)
        if text is None or mems is None:
            return None
        # In effect is what it asks for and its parent has (v2 takes a cpuset.mems naming
        # more and leaves the rest out).
        parent = parse_id_list(reach) if reach else None
        return Candidate(item.view.pod.info.uid, item.view.info.id, item.level,
                         parse_numa_stat(text, True, PAGE_SIZE),
                         mems if parent is None else mems & parent, parent)

    def _take(self, step: Step, item: Managed, balance: NumaBalanceConfig, reason: str) -> None:
        cpuset = self._layout.dir("cpuset", item.ref.rel)
        memory = self._layout.dir("memory", item.ref.rel)
        fields = {"pod_uid": step.candidate.pod_uid, "container": item.view.info.name,
                  "from_node": step.hot, "to_node": step.cool,
                  "asked_bytes": step.asked_bytes, "dry_run": balance.dry_run}
        if balance.dry_run:
            self._last = (self._clock(), step.asked_bytes)
            self._record(fields, 0, 0.0, "dry_run", reason)
            return
        allowed = step.candidate.mems
        if step.cool not in allowed and not self._set_mems(
                cpuset, allowed | {step.cool}, f"NUMA balance: node {step.cool} has headroom"):
            self._paused[step.candidate.container] = self._clock() + REFUSED_PAUSE_S
            self._record(fields, 0, 0.0, "failed",
                         f"cpuset.mems not widened to node {step.cool}")
            return
        pids = subtree_ids(self._sysfs, cpuset)
        started = self._clock()
        outcome, told, why = self._move(pids, step.hot, step.cool, step.asked_bytes,
                                        balance.step_deadline_s)
        ended = self._clock()
        after = self._sysfs.read(f"{memory}/memory.numa_stat")
        left = parse_numa_stat(after, True, PAGE_SIZE).get(step.hot, 0) if after else 0
        # A cgroup gone meanwhile has no figures after: the kernel's count is all there is.
        moved = told if after is None else max(
            step.candidate.per_node.get(step.hot, 0) - left, 0)
        if outcome is Outcome.OBSERVED:
            # Nothing moved: the rate limit spaces the held steps as if they had.
            self._last = (ended, step.asked_bytes)
            self._record(fields, 0, 0.0, "observed", why)
            return
        self._last = (ended, moved)
        result = {Outcome.WRITTEN: "done", Outcome.TIMEOUT: "timeout"}.get(outcome, "failed")
        if result == "failed":
            self._paused[step.candidate.container] = ended + REFUSED_PAUSE_S
        self._record(fields, moved, ended - started, result, why or reason)
        if outcome is Outcome.WRITTEN and after is not None and (
                told < step.asked_bytes or left <= RESIDUE_BYTES):
            # The processes' pages there are all moved (what may stay is page cache no process
            # maps, which no step and no cpuset change moves): taking the node out of
            # cpuset.mems keeps their new pages off it, and moves only what they allocated
            # since the step's scan.
            self._set_mems(cpuset, (allowed | {step.cool}) - {step.hot},
                           f"NUMA balance: memory moved off node {step.hot}")

    def _allowed(self, cpuset: str) -> frozenset[int] | None:
        """The nodes the container's cpuset.mems asks for (an empty one inherits its
        parent's)."""
        for name in ("cpuset.mems", "cpuset.mems.effective"):
            text = self._sysfs.read(f"{cpuset}/{name}")
            if text is None:
                return None
            if text.strip():
                return parse_id_list(text)
        return None

    def _set_mems(self, cpuset: str, nodes: frozenset[int], reason: str) -> bool:
        path = f"{cpuset}/cpuset.mems"
        with self._notes.handover:
            if not undo_noted(self._sysfs, self._notes, NUMA_BALANCE_NOTES, cpuset):
                return False
            return self._sysfs.write(path, format_id_list(nodes), reason) in (
                Outcome.WRITTEN, Outcome.OBSERVED)

    def _record(self, fields: dict[str, object], moved: int, duration_s: float, result: str,
                reason: str) -> None:
        if result in ("dry_run", "observed"):
            # A held step is decided again each time the rate limit allows: said once while
            # the same container would move between the same nodes.
            held = (fields["container"], fields["from_node"], fields["to_node"])
            if held == self._held:
                return
            self._held = held
        elif self._metrics is not None:
            self._metrics.numa_balance_step(result, moved, duration_s)
        self._audit.record("numa_balance_step", **fields, moved_bytes=moved,
                           duration_s=round(duration_s, 3), result=result, reason=reason)
