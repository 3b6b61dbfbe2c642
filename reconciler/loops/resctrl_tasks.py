"""resctrl task ids: every task of a managed container sits in its resctrl group.

A container's group is its pod's group (``<prefix>pod-<uid>``, with its monitor group) when that
exists, else its level's class group (``<prefix><level>``) when the level uses resctrl. The runtime
puts a new container's first task there through the CLOS id of the adjustment; this loop covers
what that misses: containers that predate the plugin, runtimes that ignore the field, tasks that
join a container from outside (``exec``), groups someone removed, and level changes.

Cost. Reading every container's thread list costs one open/read/close per container, which at
thousands of containers is most of a cycle. It is not needed every second: a new thread inherits
its parent's resctrl group, so a task can only be missing from its group if it entered the
container from outside, and such a task sits in the root group (or, for monitor groups, in the
control group but not its monitor group). So each cycle reads the task lists of the groups only,
and examines just the task ids that are *new* there since the last cycle, finding their cgroup
through ``/proc/<tid>/cgroup``. Every ``full_scan_every`` cycles, and for containers that are new
or changed group, it reads the containers' own thread lists (``tasks`` on v1, ``cgroup.threads``
on v2) as well. No written id is ever trusted from memory: ids are compared with the groups'
``tasks`` as read in the same cycle, so a reused id is handled like any other.

Task ids are written one per write (the kernel's rule); ids of tasks that exited meanwhile
(``ESRCH``) are skipped. A monitor group accepts only tasks of its control group, so a task goes to
the control group first.

Which group a container belongs to is decided by :func:`hooks.resctrl_groups.place_container`,
the function the CreateContainer answer uses too, with the level the node state decided.

Garbage collection: a pod group whose pod is no longer known, or whose pod's plan
(:func:`hooks.resctrl_annotation.plan_pod_group`) under the configuration gives it no group of
its own (after a reload, or found by a restart under such a configuration), is an orphan: no
container is placed in it any longer, and it is removed once it has been one for
``gc_grace_s`` (never before the first NRI state arrived); one the kernel will not remove yet
(``EBUSY``) stays an orphan, is tried again every cycle and said once, and never holds up the
cycle's task moves. The class groups are kept as
:func:`hooks.resctrl_groups.plan_class_groups` wants them, as at start and on a reload: one that
someone removed is created again with its configured schemata.

resctrl switched off (``resctrl.enabled = false``): every group of ours goes, class and pod groups
alike, so their tasks are back in the root group; one the kernel will not remove yet is tried
again every cycle. Switched on again, the next cycle is a full scan.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import structlog

from common.audit import AuditLog
from common.state import NodeState, PodView
from hooks.events import Event
from hooks.levels import LEVEL_NAMES
from hooks.resctrl_annotation import plan_pod_group
from hooks.resctrl_config import ResctrlConfig
from hooks.resctrl_groups import parse_group_name, place_container, plan_class_groups
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.held_writes import HeldWrites
from reconciler.host.procfs import task_cgroups
from reconciler.host.resctrlfs import ResctrlFs, removal_problem
from reconciler.host.sysfs import SysFs
from reconciler.loops.base import Loop, ReconcilerConfig
from reconciler.loops.common import Managed, ManagedCache

log = structlog.get_logger("nri_qos.reconciler")


@dataclass(frozen=True, slots=True)
class Target:
    """Where one container's tasks belong."""

    group: str
    monitor: bool
    # The container's thread-list file (system path).
    threads_file: str


class _Moves:
    """Task ids to write in this cycle, per group, each id once."""

    def __init__(self) -> None:
        self.control: dict[str, list[int]] = {}
        self.monitor: dict[str, list[int]] = {}
        self._queued: set[tuple[str, bool, int]] = set()

    def add(self, group: str, tid: int, *, monitor: bool) -> None:
        key = (group, monitor, tid)
        if key not in self._queued:
            self._queued.add(key)
            (self.monitor if monitor else self.control).setdefault(group, []).append(tid)


class ResctrlTasksSections(Protocol):
    """The sections the task-id loop reads."""

    @property
    def reconciler(self) -> ReconcilerConfig: ...

    @property
    def resctrl(self) -> ResctrlConfig: ...


class ResctrlTasksLoop(Loop):
    name = "resctrl_tasks"
    wake_events = frozenset({Event.START_CONTAINER, Event.RUN_POD_SANDBOX})
    wake_on_meta = True

    def __init__(self, config: Callable[[], ResctrlTasksSections], state: NodeState, sysfs: SysFs,
                 layout: CgroupLayout, resctrl: ResctrlFs, audit: AuditLog, *,
                 managed: ManagedCache | None = None) -> None:
        self._config = config
        self._state = state
        self._sysfs = sysfs
        self._layout = layout
        self._resctrl = resctrl
        self._audit = audit
        self._managed = ManagedCache() if managed is None else managed
        self._cycles = 0
        # Cached per (managed containers, existing groups): container id -> target, cgroup -> id.
        self._targets_key: tuple[tuple[Managed, ...], frozenset[str], ResctrlConfig] | None = None
        self._targets: dict[str, Target] = {}
        self._by_cgroup: dict[str, str] = {}
        self._scanned: dict[str, Target] = {}
        # Ids seen outside their place in the previous cycle: root group, and per monitored
        # group the ids of the control group missing from its monitor group.
        self._seen_root: frozenset[int] = frozenset()
        self._seen_unmonitored: dict[str, frozenset[int]] = {}
        # Task lists by path: the bytes read last time and their parse. Only a parse cache:
        # every list is read again each cycle, so a reused id is never trusted from memory.
        self._id_cache: dict[str, tuple[bytes, frozenset[int]]] = {}
        self._read_now: set[str] = set()
        self._orphaned_since: dict[str, float] = {}
        # Orphans whose removal failed, with the error last said.
        self._removal_failed: dict[str, str] = {}
        self._class_problems: set[str] = set()
        self._refused = HeldWrites()  # group (and monitor) -> the refusal of its moves said

    def interval(self) -> float:
        return self._config().reconciler.resctrl_interval_s

    # -- the cycle -------------------------------------------------------------------------------

    def cycle(self, now: float) -> None:
        cfg = self._config()
        if not cfg.reconciler.enabled:
            return
        if not cfg.resctrl.enabled:
            self._switched_off()
            return
        snapshot = self._state.snapshot()
        existing = set(self._resctrl.control_groups())
        recreated = self._keep_class_groups(cfg, existing)
        self._collect_garbage(existing, snapshot.pods, cfg, now, synced=self._state.synced)
        managed = self._managed.get(snapshot)
        full = self._cycles % cfg.reconciler.full_scan_every == 0
        self._cycles += 1
        if full:
            # Also refreshes which pod groups have a monitor group (made just after the group).
            self._targets_key = None
        targets = self._targets_for(managed, frozenset(existing), cfg)

        in_use = {t.group for t in targets.values()}
        monitored = {t.group for t in targets.values() if t.monitor}
        control = {g: self._group_tasks(g, monitor=False) for g in in_use}
        monitors = {g: self._group_tasks(g, monitor=True) for g in monitored}
        root = self._ids(self._resctrl.tasks_file(None))
        unmonitored = {g: control[g] - monitors[g] for g in monitored}
        self._id_cache = {path: self._id_cache[path] for path in self._read_now}
        self._read_now = set()

        moves = _Moves()
        if full:
            scan: Iterable[str] = targets
        else:
            # New containers, containers whose group changed, and members of a recreated group.
            scan = [] if targets is self._scanned and not recreated else [
                cid for cid, t in targets.items()
                if self._scanned.get(cid) != t or t.group in recreated]
            fresh: set[int] = set() if root is self._seen_root else set(root - self._seen_root)
            for group, tids in unmonitored.items():
                seen = self._seen_unmonitored.get(group, frozenset())
                if tids != seen:
                    fresh |= tids - seen
            self._classify(fresh, targets, control, monitors, moves)
        for cid in scan:
            self._scan_container(targets[cid], control, monitors, moves)
        self._scanned = targets
        self._seen_root = root
        self._seen_unmonitored = unmonitored
        self._apply(moves)

    # -- targets ---------------------------------------------------------------------------------

    def _targets_for(self, managed: tuple[Managed, ...], existing: frozenset[str],
                     cfg: ResctrlTasksSections) -> dict[str, Target]:
        key = (managed, existing, cfg.resctrl)
        if self._targets_key is not None and self._targets_key[0] is managed \
                and self._targets_key[1] == existing and self._targets_key[2] is cfg.resctrl:
            return self._targets
        targets: dict[str, Target] = {}
        by_cgroup: dict[str, str] = {}
        monitor_cache: dict[str, bool] = {}
        threads = self._layout.threads_file
        controller = self._layout.task_controller
        planned: dict[tuple[str, str], str | None] = {}
        for item in managed:
            pod = item.view.pod.info
            if (pod.uid, item.level) not in planned:
                planned[pod.uid, item.level] = plan_pod_group(pod, item.level, cfg.resctrl,
                                                              self._resctrl.info).group
            placement = place_container(planned[pod.uid, item.level], item.level, cfg.resctrl,
                                        existing.__contains__)
            group = placement.group
            if group is None:
                continue
            monitor = False
            if placement.pod_group:
                if group not in monitor_cache:
                    monitor_cache[group] = self._resctrl.has_monitor(group)
                monitor = monitor_cache[group]
            cgroup = self._layout.dir(controller, item.ref.rel)
            targets[item.view.info.id] = Target(group, monitor, f"{cgroup}/{threads}")
            by_cgroup["/" + item.ref.rel] = item.view.info.id
        self._targets_key, self._targets, self._by_cgroup = key, targets, by_cgroup
        return targets

    def _group_tasks(self, group: str, *, monitor: bool) -> frozenset[int]:
        return self._ids(self._resctrl.tasks_file(group, monitor=monitor))

    def _ids(self, path: str) -> frozenset[int]:
        """A task list, read every cycle; parsed again only when its bytes changed."""
        self._read_now.add(path)
        data = self._resctrl.sysfs.read_bytes(path) or b""
        cached = self._id_cache.get(path)
        if cached is not None and cached[0] == data:
            return cached[1]
        ids = frozenset(map(int, data.split()))
        self._id_cache[path] = (data, ids)
        return ids

    # -- finding missing ids ---------------------------------------------------------------------

    def _scan_container(self, target: Target, control: dict[str, frozenset[int]],
                        monitors: dict[str, frozenset[int]], moves: _Moves) -> None:
        tids = self._sysfs.read_ids(target.threads_file)
        if not tids:
            return
        in_group = control[target.group]
        in_monitor = monitors.get(target.group)
        for tid in tids:
            if tid not in in_group:
                moves.add(target.group, tid, monitor=False)
            if in_monitor is not None and tid not in in_monitor:
                moves.add(target.group, tid, monitor=True)

    def _classify(self, fresh: set[int], targets: dict[str, Target],
                  control: dict[str, frozenset[int]], monitors: dict[str, frozenset[int]],
                  moves: _Moves) -> None:
        """Place ids that newly appeared outside their group, by their cgroup."""
        for tid in fresh:
            cid = self._container_of(tid)
            target = targets.get(cid) if cid is not None else None
            if target is None:
                continue
            if tid not in control[target.group]:
                moves.add(target.group, tid, monitor=False)
            if target.monitor and tid not in monitors[target.group]:
                moves.add(target.group, tid, monitor=True)

    def _container_of(self, tid: int) -> str | None:
        text = task_cgroups(self._sysfs, tid)
        if text is None:
            return None
        path = _cgroup_of(text, self._layout.v2, self._layout.task_controller)
        # A task in a cgroup nested inside a container's (VM runtimes, systemd in a container)
        # belongs to that container: walk up until a known container cgroup is found.
        while path and path != "/":
            cid = self._by_cgroup.get(path)
            if cid is not None:
                return cid
            path = path.rsplit("/", 1)[0]
        return None

    def _apply(self, moves: _Moves) -> None:
        for group, tids in moves.control.items():
            self._add(group, tids, monitor=False)
        for group, tids in moves.monitor.items():
            self._add(group, tids, monitor=True)

    def _add(self, group: str, tids: list[int], *, monitor: bool) -> None:
        where = f"{group} monitor" if monitor else group
        try:
            self._resctrl.add_tasks(group, tids, monitor=monitor)
        except OSError as exc:
            if exc.errno == errno.EROFS:
                return  # a read-only tree: the host layer said so once
            # The group vanished or refused (e.g. a monitor group whose RMID is gone); the next
            # cycle sees the new state of the groups, and tries again: said once while the
            # group refuses so.
            if self._refused.news(where, str(exc)):
                log.warning("resctrl_task_move_failed", group=group, monitor=monitor,
                            count=len(tids), error=str(exc))
            return
        self._refused.forget(where)

    # -- group maintenance -----------------------------------------------------------------------

    def _keep_class_groups(self, cfg: ResctrlTasksSections, existing: set[str]) -> set[str]:
        """Repair the class groups (a removed one is made again); the groups that were made."""
        plan = plan_class_groups(cfg.resctrl, self._resctrl.info, existing)
        changed = self._resctrl.apply_class_groups(
            plan, reason="class group repair: missing or its schemata changed",
            warn=self._warn_class_group)
        recreated = changed - existing
        existing |= recreated
        existing.difference_update(plan.remove)
        return recreated

    def _switched_off(self) -> None:
        """Remove what is left of our groups: the reload removed them, this retries what the
        kernel refused then."""
        failed = self._resctrl.remove_our_groups(reason="resctrl.enabled is false")
        for group, problem in failed.items():
            if self._removal_failed.get(group) != problem:
                log.warning("resctrl_group_not_removed", group=group, error=problem)
        self._removal_failed = failed
        self._orphaned_since = {}
        # Switched on again, every container is placed anew.
        self._cycles = 0

    def _warn_class_group(self, problem: str) -> None:
        # Once per distinct problem: the loop retries every second.
        if problem not in self._class_problems:
            self._class_problems.add(problem)
            log.warning("resctrl_class_group_failed", error=problem)

    def _collect_garbage(self, existing: set[str], pods: Mapping[str, PodView],
                         cfg: ResctrlTasksSections, now: float, *, synced: bool) -> None:
        """Remove the pod groups no pod has (``pods``: the node state's, by sandbox) and those
        whose pod's plan under the configuration gives it no group of its own: both orphans."""
        if not synced:
            return
        grace = cfg.reconciler.gc_grace_s
        views = {view.info.uid: view for view in pods.values()}
        orphans: set[str] = set()
        for group in sorted(existing):
            ref = parse_group_name(self._resctrl.prefix, group, LEVEL_NAMES)
            if ref is None or ref.kind != "pod":
                continue
            view = views.get(ref.key)
            if view is None:
                why = f"pod {ref.key} is gone"
            # The plan decides, not the containers: a group is made at RunPodSandbox, before
            # any container uses it. Pod groups are few (one CLOS each), so planning them
            # every cycle costs little.
            elif plan_pod_group(view.info, view.level, cfg.resctrl,
                                self._resctrl.info).group != group:
                why = f"pod {ref.key}: the configuration gives it no group of its own"
            else:
                continue
            orphans.add(group)
            since = self._orphaned_since.setdefault(group, now)
            if now - since < grace:
                continue
            try:
                removed = self._resctrl.remove_group(
                    group, reason=f"{why} (orphaned for {now - since:.0f} s)")
            except OSError as exc:
                # EBUSY, EROFS ...: the group stays an orphan and is tried again next cycle;
                # said once per group and error, and this cycle's task moves go on.
                problem = removal_problem(exc)
                if self._removal_failed.get(group) != problem:
                    log.warning("resctrl_group_not_removed", group=group, error=problem)
                self._removal_failed[group] = problem
                continue
            if removed:
                existing.discard(group)
            orphans.discard(group)
        self._orphaned_since = {g: t for g, t in self._orphaned_since.items() if g in orphans}
        self._removal_failed = {g: p for g, p in self._removal_failed.items() if g in orphans}


def _cgroup_of(text: str, v2: bool, controller: str) -> str | None:
    """The task's cgroup path from ``/proc/<tid>/cgroup`` (v2: the ``0::`` line; v1: the line of
    the hierarchy holding ``controller``)."""
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if v2:
            if hierarchy == "0" and controllers == "":
                return path
        elif controller in controllers.split(","):
            return path
    return None
