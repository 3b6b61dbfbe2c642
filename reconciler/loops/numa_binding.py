"""NUMA binding: keep reclaimed pods' memory on the NUMA nodes that have room for it.

Each cycle ranks the nodes by headroom (free memory above the memory guard's watermark,
``max(floor, low watermark x factor)``) and binds every container of a ``reclaimed_cores`` pod to
the nodes with positive headroom (the ``max_nodes`` best of them when that is set, keeping the
current choice while it still has headroom) through ``cpuset.mems``. A node whose free memory
falls under its watermark therefore drops out of the binding and the reclaimed pods move off it:
cgroup v2 migrates a cgroup's pages when ``cpuset.mems`` changes; on v1 that needs
``cpuset.memory_migrate = 1``, set first.

When no node has headroom, bindings stay as they are (moving memory between full nodes helps
nobody; the memory guard and the mitigations deal with that). A single-node host is a no-op.

Only nodes with CPUs and memory are chosen (:func:`~reconciler.host.numa.local_nodes`). A node of
memory alone (far memory, HBM, a GPU's) stays in a container's ``cpuset.mems`` when it is there
and is never added: what the kernel demotes there is its own tiering, and HBM or a GPU's memory
is not the offline tier's. A host with one local node and far memory has nothing to choose.

A container's ``cpuset.mems`` (and on v1 ``cpuset.memory_migrate``) from before its first
binding is noted in the state file (:mod:`reconciler.host.statefile`) and written back when the
binding goes away (switched off by a reload, the container's pod no longer ``reclaimed_cores``,
or ``nri-qos reset``); notes of containers that are gone are dropped. An empty ``cpuset.mems``
(v2's default: the parent's nodes) comes back as the nodes it gave (:func:`mems_note`), and an
empty note as the parent's nodes (:func:`mems_restored`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import structlog

from common.audit import AuditLog
from common.state import NodeState
from hooks.config_fields import setting
from hooks.events import Event
from hooks.levels import QosLevel
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.numa import NumaNode, local_nodes, read_nodes
from reconciler.host.statefile import StateFile, restore_noted
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.host.values import PAGE_SIZE, format_id_list, parse_id_list, same_id_list
from reconciler.host.watermarks import Watermarks
from reconciler.loops.base import Loop, ReconcilerConfig
from reconciler.loops.common import Managed, ManagedCache
from reconciler.loops.memory_guard import MemoryGuardConfig

log = structlog.get_logger("nri_qos.reconciler")


@dataclass(frozen=True, slots=True)
class NumaConfig:
    enabled: bool = setting(True, "Bind reclaimed pods to the NUMA nodes with most headroom.")
    interval_s: float = setting(10.0, "Period of the binding loop.", unit="seconds",
                                minimum=0.1, maximum=3600)
    migrate_memory: bool = setting(
        True, "cgroup v1: set cpuset.memory_migrate so pages follow a new binding."
    )
    max_nodes: int = setting(
        0, "Bind reclaimed pods to at most this many NUMA nodes, those with most headroom "
        "(0: every node with free memory above its watermark).", minimum=0, maximum=1024,
    )



def choose_nodes(nodes: list[NumaNode], floor_bytes: int, scale_factor: float,
                 max_nodes: int, keep: frozenset[int] = frozenset(),
                 floor_percent: float | None = None) -> list[int]:
    """Nodes with headroom, most headroom first; at most ``max_nodes`` (0: no limit).

    Nodes in ``keep`` (the current choice) come first while they still have headroom, so two
    nodes with similar headroom do not trade places every cycle and migrate memory back and
    forth."""
    ranked = sorted(((n.headroom(floor_bytes, scale_factor, floor_percent), n.id)
                     for n in nodes),
                    key=lambda item: (item[1] not in keep, -item[0], item[1]))
    chosen = [node for room, node in ranked if room > 0]
    return sorted(chosen[:max_nodes]) if max_nodes else sorted(chosen)


class BalanceSwitch(Protocol):
    """Of the NUMA balance section, whether it runs (it then takes nodes out of bindings)."""

    @property
    def enabled(self) -> bool: ...


class NumaBindingSections(Protocol):
    """The sections the NUMA binding loop reads (the guard's watermark decides the headroom)."""

    @property
    def numa_balance(self) -> BalanceSwitch: ...

    @property
    def reconciler(self) -> ReconcilerConfig: ...

    @property
    def numa(self) -> NumaConfig: ...

    @property
    def memory_guard(self) -> MemoryGuardConfig: ...


NUMA_NOTES = "numa_binding"
"""The state file's section: a container's cpuset.mems file -> its value before binding."""
NUMA_BALANCE_NOTES = "numa_balance"
"""The same for the files the NUMA balance changed first. A file is noted in one section only,
by the loop that changed it first (the other finds the note and adds none), so its note is the
value from before either, and the loop that noted it writes it back when it is switched off."""


def noted_elsewhere(notes: StateFile, section: str, path: str) -> bool:
    """Whether the other NUMA loop noted ``path`` already (it then owns the undo). Each loop
    runs on its own thread: from this look to its write, and in a give-back, a loop holds
    ``notes.handover``, or the other could write its note back and forget it in between and
    leave the write noted nowhere."""
    other = NUMA_BALANCE_NOTES if section == NUMA_NOTES else NUMA_NOTES
    return path in notes.entries(other)


EFFECTIVE_MEMS = ("cpuset.mems.effective", "cpuset.effective_mems")
"""The file of the nodes a cpuset has in effect: v2's name, v1's (a hierarchy has one of them)."""


def effective_mems(sysfs: SysFs, cgroup: str) -> str:
    """The nodes ``cgroup`` has in effect, as its file says them ("" when it has none)."""
    for name in EFFECTIVE_MEMS:
        text = sysfs.read(f"{cgroup}/{name}")
        if text is not None:
            return text.strip()
    return ""


def undo_noted(sysfs: SysFs, notes: StateFile, section: str, cgroup: str) -> bool:
    """Whether the value ``cgroup``'s ``cpuset.mems`` holds now is noted, by the other loop or
    now in ``section``: a loop writes the file only then, holding ``notes.handover``."""
    path = f"{cgroup}/cpuset.mems"
    current = sysfs.read(path)
    return current is not None and (
        noted_elsewhere(notes, section, path)
        or notes.remember(section, path, mems_note(sysfs, cgroup, current)))


def mems_note(sysfs: SysFs, cgroup: str, current: str) -> str:
    """What a container's ``cpuset.mems`` (``current``) is noted as, to be written back.

    An empty one cannot be written back as it was: the kernel takes a write of no bytes as no
    write at all, and refuses an empty ``cpuset.mems`` to a cgroup with processes (ENOSPC). On
    v2 it means the parent's nodes, so the nodes it gives (:func:`effective_mems`) are noted:
    the container gets the same nodes back. A v1 cpuset is made with no nodes (none in effect
    either) and holds no process while it has none: empty is noted, and
    :func:`mems_restored` gives it the parent's nodes when it goes back."""
    if current.strip():
        return current.strip()
    return effective_mems(sysfs, cgroup)


def mems_restored(sysfs: SysFs, path: str, noted: str) -> str:
    """What a NUMA note of ``path`` is written back as: an empty ``cpuset.mems`` (a v1 cpuset
    bound before a process joined it, or a note of an earlier agent) as the nodes its parent has
    in effect, which are the nodes an empty one gives on v2 and the ones a process in it needs
    on v1, where the kernel refuses an empty one (ENOSPC)."""
    if noted or not path.endswith("/cpuset.mems"):
        return noted
    return effective_mems(sysfs, path.rsplit("/", 2)[0])


def restore_bindings(sysfs: SysFs, notes: StateFile, reason: str,
                     section: str = NUMA_NOTES) -> int:
    """Writes back every cpuset.mems noted in ``section``; how many were written."""
    with notes.handover:
        return restore_noted(sysfs, notes, section, reason, resolve=mems_restored)


def release_unreclaimed(items: Iterable[Managed], sysfs: SysFs, layout: CgroupLayout,
                        notes: StateFile, section: str) -> None:
    """Writes back what ``section`` noted for containers whose pod is no longer
    ``reclaimed_cores`` (its level changed by a reload or the pod's metadata): only reclaimed
    pods are bound or moved, so nothing else would ever give them their nodes back."""
    if not notes.entries(section):
        return
    for item in items:
        if item.level != QosLevel.RECLAIMED_CORES:
            with notes.handover:
                restore_noted(sysfs, notes, section,
                              f"pod no longer {QosLevel.RECLAIMED_CORES}",
                              under=f"{layout.dir('cpuset', item.ref.rel)}/",
                              resolve=mems_restored)


class NumaBindingLoop(Loop):
    name = "numa_binding"
    wake_events = frozenset({Event.START_CONTAINER})
    wake_on_meta = True

    def __init__(self, config: Callable[[], NumaBindingSections], state: NodeState, sysfs: SysFs,
                 layout: CgroupLayout, audit: AuditLog, *,
                 managed: ManagedCache | None = None, notes: StateFile | None = None,
                 watermarks: Watermarks | None = None) -> None:
        """``watermarks``: the zones' low watermarks as the agent's loops share them (None:
        this loop's own)."""
        self._watermarks = watermarks if watermarks is not None else Watermarks(sysfs)
        self._notes = notes if notes is not None else StateFile(None)
        self._was_held = False
        self._config = config
        self._state = state
        self._sysfs = sysfs
        self._layout = layout
        self._audit = audit
        self._managed = ManagedCache() if managed is None else managed
        self._chosen: frozenset[int] = frozenset()
        # Said that a container's cgroup has no cpuset.mems (said once: every cycle would
        # find it so again).
        self._said_no_cpuset = False
        # Said that no node has headroom: a busy node's page cache keeps it so for days.
        self._said_no_headroom = False

    def interval(self) -> float:
        return self._config().numa.interval_s

    def cycle(self, now: float) -> None:
        cfg = self._config()
        if not (cfg.reconciler.enabled and cfg.numa.enabled):
            if self._notes.entries(NUMA_NOTES):
                restore_bindings(self._sysfs, self._notes, "NUMA binding switched off")
            self._chosen = frozenset()
            return
        held = self._sysfs.held()
        if held and not self._was_held and self._notes.entries(NUMA_NOTES):
            # Observe: the bindings an enforcing run made go back (see the memory guard).
            restore_bindings(self._sysfs, self._notes,
                             "observe mode: the node is watched, not acted on")
            self._chosen = frozenset()
        self._was_held = held
        for path in self._notes.entries(NUMA_NOTES):
            if not self._sysfs.exists(path):
                self._notes.forget(NUMA_NOTES, path)
        managed = self._managed.get(self._state.snapshot())
        release_unreclaimed(managed, self._sysfs, self._layout, self._notes, NUMA_NOTES)
        balancing = cfg.numa_balance.enabled and self._layout.v2
        marks = self._watermarks.at(now)
        nodes = local_nodes(read_nodes(self._sysfs, PAGE_SIZE, lows=marks.node_lows(),
                                       far=marks.far))
        if len(nodes) < 2:
            return
        guard = cfg.memory_guard
        chosen = choose_nodes(nodes, guard.watermark_floor_bytes, guard.watermark_scale_factor,
                              cfg.numa.max_nodes, self._chosen, guard.watermark_floor_percent)
        if not chosen:
            if not self._said_no_headroom:
                self._said_no_headroom = True
                log.info("numa_binding_unchanged", reason="no node has free memory above its "
                                                          "watermark; said again when one has")
            return
        self._chosen = frozenset(chosen)
        mems = format_id_list(chosen)
        if self._said_no_headroom:
            self._said_no_headroom = False
            log.info("numa_binding_headroom", nodes=mems)
        hot = sorted(n.id for n in nodes if n.id not in chosen)
        reason = f"NUMA nodes with headroom: {mems}" + (
            f"; nodes under watermark or not chosen: {format_id_list(hot)}" if hot else "")
        if marks.far:
            reason += f"; memory-only nodes kept as they are: {format_id_list(marks.far)}"
        migrate = not self._layout.v2 and cfg.numa.migrate_memory
        for item in managed:
            if item.level != QosLevel.RECLAIMED_CORES:
                continue
            # One container's odd cgroup must not keep the others from being bound.
            try:
                self._bind(item, chosen, marks.far, reason, migrate, balancing)
            except (OSError, ValueError) as exc:
                log.warning("numa_binding_failed", container=item.view.info.name,
                            pod_uid=item.view.pod.info.uid, error=str(exc))

    def _bind(self, item: Managed, chosen: list[int], far: frozenset[int], reason: str,
              migrate: bool, balancing: bool) -> None:
        cgroup = self._layout.dir("cpuset", item.ref.rel)
        current = self._sysfs.read(f"{cgroup}/cpuset.mems")
        if current is None:
            if not self._said_no_cpuset and self._sysfs.is_dir(cgroup):
                # Not a container gone meanwhile: its cgroup is there without the file.
                self._said_no_cpuset = True
                log.warning("numa_binding_unavailable", path=cgroup,
                            reason="no cpuset.mems: the cpuset controller is not enabled in "
                                   "the parents' cgroup.subtree_control (cgroup v2); "
                                   "reclaimed pods are not bound")
            return
        # The kernel takes only nodes the parent has in effect (v1 refuses the others,
        # v2 takes them and leaves them out of effect): chosen for the host, not for the pod.
        reach = effective_mems(self._sysfs, cgroup.rsplit("/", 1)[0])
        nodes = set(chosen) & parse_id_list(reach) if reach else set(chosen)
        if not nodes:
            return
        if far and not balancing:
            # Far memory it has stays: taking it away would move its pages back into the
            # local nodes the binding keeps room on (the balance's case below keeps every
            # node it has, far ones included).
            nodes |= far & parse_id_list(effective_mems(self._sysfs, cgroup))
        if balancing:
            # Taking a node away would move all the pages held there in one write: the
            # balancer does that in bounded steps, so the binding only adds nodes.
            allowed = current if current.strip() else self._sysfs.read(
                f"{cgroup}/cpuset.mems.effective")
            nodes |= parse_id_list(allowed or "")
        mems = format_id_list(nodes)
        if same_id_list(current, mems):
            return
        path = f"{cgroup}/cpuset.mems"
        with self._notes.handover:
            # Read again: the balance may have given the file back since.
            if not undo_noted(self._sysfs, self._notes, NUMA_NOTES, cgroup):
                return
            if migrate:
                # Only needed when the binding changes, and it must be in place before.
                flag = f"{cgroup}/cpuset.memory_migrate"
                before = self._sysfs.read(flag)
                if before is None or \
                        not self._notes.remember(NUMA_NOTES, flag, before.strip()):
                    return
                self._sysfs.write_if_changed(flag, "1", "pages follow the NUMA binding")
            outcome = self._sysfs.write(path, mems, reason)
        if outcome == Outcome.WRITTEN:
            info = item.view.info
            self._audit.record("numa_binding", pod_uid=item.view.pod.info.uid,
                               container=info.name, mems=mems, reason=reason)
