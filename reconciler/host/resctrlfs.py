"""The resctrl filesystem, mounted at a system path (``/sys/fs/resctrl``) below the sysfs root.

Everything that touches resctrl goes through :class:`ResctrlFs`, and everything it reads or
writes goes through :class:`~.sysfs.SysFs`: one root, one writer, one audit path. Group names are
validated again here, so no caller can build a path outside the mount. Schemata are written only
when they differ from what the kernel reports.

In observe mode a group limits nothing: its schemata stay at the kernel's default (the whole cache
and bandwidth), and a limit an enforcing run left is written back to that default, since undoing
is never held back.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Collection, Iterable, Mapping

from common.audit import AuditLog
from hooks.levels import LEVEL_NAMES
from hooks.resctrl import Allocation, ResctrlInfo, Schemata, build_schemata
from hooks.resctrl_groups import ClassGroupPlan, parse_group_name, valid_group_name
from hooks.untrusted import bounded_repr
from reconciler.host.resctrl_files import (
    INFO_FILES,
    ResctrlUnavailable,
    UnreadableInfo,
    parse_info,
    parse_schemata,
    schemata_matches,
    schemata_text,
)
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import Outcome, SysFs

_NOT_GROUPS = frozenset({"info", "mon_groups", "mon_data"})
PREFIX_NOTES = "resctrl_prefix"
"""The state file's section: each group prefix the agent made groups with -> the resctrl mount
(``resctrl.group_prefix`` is read at start, so a run with another one would not find them)."""


class GroupError(Exception):
    """A group could not be created or configured; ``no_space`` when the kernel ran out of ids."""

    def __init__(self, group: str, reason: str, *, no_space: bool = False) -> None:
        super().__init__(f"{group}: {reason}")
        self.group = group
        self.no_space = no_space


def read_info(sysfs: SysFs, mount: str, amd_mb_max: int) -> ResctrlInfo:
    """Describe the resctrl hardware mounted at ``mount``; raise :class:`ResctrlUnavailable`."""
    base = mount.rstrip("/")
    root_schemata = sysfs.read(f"{base}/schemata") if sysfs.is_dir(f"{base}/info") else None
    if root_schemata is None:
        raise ResctrlUnavailable(f"resctrl is not mounted at {mount}")
    try:
        files = {name: sysfs.read(f"{base}/info/{name}") for name in INFO_FILES}
        return parse_info(root_schemata, files, has_l3=sysfs.is_dir(f"{base}/info/L3"),
                          has_mb=sysfs.is_dir(f"{base}/info/MB"),
                          monitoring=sysfs.is_dir(f"{base}/info/L3_MON"),
                          amd_mb_max=amd_mb_max)
    except (OSError, UnreadableInfo) as exc:
        raise ResctrlUnavailable(f"cannot read resctrl info under {mount}: {exc}") from exc


def removal_problem(exc: OSError) -> str:
    """A refused ``rmdir`` (``EBUSY``, ``EROFS`` ...) as said in logs."""
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def _limits(current: Mapping[str, Mapping[int, str]], unlimited: Schemata) -> bool:
    """Whether ``current`` (see :func:`parse_schemata`) shows a value below ``unlimited`` for a
    cache id this agent manages; one it cannot parse counts as a limit."""
    for name, full, base in (("L3", unlimited.l3, 16), ("MB", unlimited.mb, 10)):
        for cid, text in current.get(name, {}).items():
            if cid not in full:
                continue
            try:
                if int(text, base) != full[cid]:
                    return True
            except ValueError:
                return True
    return False


class ResctrlFs:
    """Groups, schemata and tasks under one resctrl mount."""

    def __init__(self, sysfs: SysFs, mount: str, info: ResctrlInfo, *, prefix: str,
                 audit: AuditLog) -> None:
        self.sysfs = sysfs
        self.mount = mount.rstrip("/")
        self.info = info
        self.prefix = prefix
        self._audit = audit
        # Writes that undo a limit, done in observe mode too.
        self._undo = sysfs.unobserved()
        # What a group limits nothing with: every way of every cache, the whole bandwidth.
        self._unlimited = build_schemata(Allocation(), info)
        # Budget check and mkdir must not interleave between two pods created concurrently.
        self._lock = threading.Lock()

    @classmethod
    def detect(cls, sysfs: SysFs, mount: str, *, prefix: str, audit: AuditLog, amd_mb_max: int,
               warn: Callable[[str], None]) -> ResctrlFs | None:
        """The filesystem, or None (after exactly one ``warn``) when resctrl cannot be used."""
        try:
            info = read_info(sysfs, mount, amd_mb_max)
        except ResctrlUnavailable as exc:
            warn(f"resctrl disabled: {exc}")
            return None
        return cls(sysfs, mount, info, prefix=prefix, audit=audit)

    # --- paths ---------------------------------------------------------------------------------

    def group_path(self, group: str) -> str:
        """The system path of a control group."""
        if not valid_group_name(group):
            raise ValueError(f"invalid resctrl group name {bounded_repr(group)}")
        return f"{self.mount}/{group}"

    def monitor_path(self, group: str) -> str:
        """The system path of a control group's monitor group of the same name."""
        return f"{self.group_path(group)}/mon_groups/{group}"

    def tasks_file(self, group: str | None, *, monitor: bool = False) -> str:
        """The ``tasks`` file of a group (its monitor group), or of the root group (None)."""
        if group is None:
            return f"{self.mount}/tasks"
        return f"{self.monitor_path(group) if monitor else self.group_path(group)}/tasks"

    # Called on every CreateContainer: a stat, nothing more.
    def has_group(self, group: str) -> bool:
        return self.sysfs.is_dir(self.group_path(group))

    def has_monitor(self, group: str) -> bool:
        return self.sysfs.is_dir(self.monitor_path(group))

    def control_groups(self) -> list[str]:
        """Every control group below the root, ours or not (each holds a CLOS)."""
        return [name for name in self.sysfs.list_subdirs(self.mount or "/")
                if name not in _NOT_GROUPS]

    def our_groups(self) -> list[str]:
        """Control groups carrying this agent's prefix (for garbage collection)."""
        return [g for g in self.control_groups()
                if g.startswith(self.prefix) and valid_group_name(g)]

    # --- group prefixes of earlier runs --------------------------------------------------------

    def note_prefix(self, notes: StateFile) -> None:
        """Notes this filesystem's prefix before any group is made with it: a later run with
        another prefix finds the groups by it (:meth:`old_groups`)."""
        notes.put(PREFIX_NOTES, self.prefix, self.mount)

    def old_groups(self, notes: StateFile) -> list[str]:
        """The groups made with the other prefixes noted for this mount (a group that is one
        of this prefix's own too is left out)."""
        return [group for group in self.control_groups()
                for prefix in self._old_prefixes(notes)
                if parse_group_name(prefix, group, LEVEL_NAMES) is not None
                and parse_group_name(self.prefix, group, LEVEL_NAMES) is None]

    def forget_prefixes(self, notes: StateFile, *, own: bool) -> None:
        """Forgets each other prefix noted for this mount, and with ``own`` this one, whose
        groups are all gone."""
        groups = self.control_groups()
        for prefix in [*self._old_prefixes(notes), *([self.prefix] if own else [])]:
            if not any(parse_group_name(prefix, g, LEVEL_NAMES) is not None for g in groups):
                notes.forget(PREFIX_NOTES, prefix)

    def remove_old_groups(self, notes: StateFile, reason: str) -> dict[str, str]:
        """Removes the groups of :meth:`old_groups` and forgets the prefixes left without any;
        the groups that could not be removed yet, with why."""
        failed = {}
        for group in self.old_groups(notes):
            try:
                self.remove_group(group, reason=reason)
            except OSError as exc:
                failed[group] = removal_problem(exc)
        self.forget_prefixes(notes, own=False)
        return failed

    def _old_prefixes(self, notes: StateFile) -> list[str]:
        return [prefix for prefix, mount in notes.entries(PREFIX_NOTES).items()
                if mount == self.mount and prefix != self.prefix]

    # --- schemata ------------------------------------------------------------------------------

    def read_schemata(self, group: str) -> dict[str, dict[int, str]]:
        return parse_schemata(self.sysfs.read(f"{self.group_path(group)}/schemata") or "")

    def ensure_group(self, group: str, schemata: Schemata, reason: str) -> bool:
        """Create ``group`` if needed and make its schemata match; True when anything changed.

        In observe mode the write of ``schemata`` is only audited as held back, and the group is
        left at, or given back, the kernel's default (:meth:`lift_limits`).
        """
        path = self.group_path(group)
        try:
            created = self.sysfs.make_dir(path)
        except OSError as exc:
            raise GroupError(group, f"mkdir: {exc.strerror}",
                             no_space=exc.errno == errno.ENOSPC) from exc
        # A new group holds the kernel's default schemata: nothing to compare with.
        current = {} if created else self._current(group)
        if self.sysfs.held():
            if not schemata_matches(schemata, current):
                self.sysfs.write(f"{path}/schemata", schemata_text(schemata),
                                 f"resctrl group {group}: {reason}", create=True)
            return self._lift(group, current) or created
        if schemata_matches(schemata, current):
            return False
        outcome = self.sysfs.write(f"{path}/schemata", schemata_text(schemata),
                                   f"resctrl group {group}: {reason}", create=True)
        if outcome is not Outcome.WRITTEN:
            if created:
                self.sysfs.remove_dir(path)
            raise GroupError(group, f"schemata {list(schemata.lines())}: {outcome.value}")
        self._audit.record("resctrl_group_created", group=group,
                           schemata=list(schemata.lines()), reason=reason, created=created)
        return True

    def lift_limits(self, group: str) -> bool:
        """Give an existing group the kernel's default schemata (no limit) when it shows a
        narrower one; True when written. Done in observe mode too: it undoes a limit."""
        return self._lift(group, self._current(group))

    def _current(self, group: str) -> dict[str, dict[int, str]]:
        try:
            return self.read_schemata(group)
        except OSError:
            return {}

    def _lift(self, group: str, current: dict[str, dict[int, str]]) -> bool:
        if not _limits(current, self._unlimited):
            return False
        reason = "observe mode: no limit (the kernel's default)"
        outcome = self._undo.write(f"{self.group_path(group)}/schemata",
                                   schemata_text(self._unlimited),
                                   f"resctrl group {group}: {reason}")
        if outcome is not Outcome.WRITTEN:
            return False
        self._audit.record("resctrl_group_created", group=group,
                           schemata=list(self._unlimited.lines()), reason=reason, created=False)
        return True

    def apply_class_groups(self, plan: ClassGroupPlan, *, reason: str,
                           warn: Callable[[str], None]) -> set[str]:
        """Make the class groups of ``plan`` exist with their schemata and remove the ones it
        retires; the groups created or rewritten. A group that cannot be had is warned about
        and skipped: its level's containers then stay where they are. One the kernel will not
        remove yet (``EBUSY``, ``EROFS`` ...) is warned about and stays, for the next plan to
        retire again: the caller goes on with its reload or its cycle's task moves."""
        changed: set[str] = set()
        for group, schemata in plan.ensure.items():
            try:
                if self.ensure_group(group, schemata, reason=reason):
                    changed.add(group)
            except (GroupError, OSError) as exc:
                warn(f"resctrl class group {group} unavailable: {exc}")
        for group, level in plan.remove.items():
            try:
                self.remove_group(group, reason=f"level {level} disabled")
            except OSError as exc:
                warn(f"resctrl class group {group} of level {level}, disabled, not removed: "
                     f"{removal_problem(exc)}")
        return changed

    # --- pod groups ----------------------------------------------------------------------------

    def can_add_group(self, class_groups: Collection[str]) -> bool:
        """Room for one more control group, keeping a CLOS for every class group and the root."""
        existing = self.control_groups()
        missing = [g for g in class_groups if g not in existing]
        return 1 + len(existing) + len(missing) < self.info.num_closids

    def create_pod_group(self, group: str, schemata: Schemata, *, pod_uid: str,
                         class_groups: Collection[str], fallback: str | None) -> str | None:
        """Create a pod's control group (and monitor group); on CLOS exhaustion or any failure
        use ``fallback`` (the level's class group) instead. Returns the group to use."""
        with self._lock:
            if not self.has_group(group) and not self.can_add_group(class_groups):
                return self._fallback(pod_uid, fallback, f"CLOS budget exhausted "
                                      f"({self.info.num_closids} CLOS)")
            try:
                self.ensure_group(group, schemata, reason=f"pod {pod_uid}")
            except GroupError as exc:
                why = "no CLOS left (ENOSPC)" if exc.no_space else str(exc)
                return self._fallback(pod_uid, fallback, why)
        if self.info.monitoring:
            self.ensure_monitor_group(group)
        return group

    def _fallback(self, pod_uid: str, fallback: str | None, reason: str) -> str | None:
        self._audit.record("resctrl_fallback", pod_uid=pod_uid, group=fallback or "", reason=reason)
        return fallback

    def ensure_monitor_group(self, group: str) -> bool:
        """``<group>/mon_groups/<group>``; False when it cannot be had (e.g. no RMID left)."""
        try:
            # The kernel provides mon_groups in every control group; a plain tree lacks it.
            self.sysfs.make_dir(f"{self.group_path(group)}/mon_groups")
            self.sysfs.make_dir(self.monitor_path(group))
        except OSError:
            return False
        return True

    def remove_group(self, group: str, reason: str) -> bool:
        """Remove a control group with its monitor groups; False when it did not exist."""
        if not self.sysfs.remove_dir(self.group_path(group)):
            return False
        self._audit.record("resctrl_group_removed", group=group, reason=reason)
        return True

    def remove_our_groups(self, reason: str) -> dict[str, str]:
        """Remove every group carrying this agent's prefix, class and pod groups alike (the
        kernel hands their tasks back to the root group); the groups that could not be removed
        yet, with why."""
        failed = {}
        for group in self.our_groups():
            try:
                self.remove_group(group, reason=reason)
            except OSError as exc:
                failed[group] = removal_problem(exc)
        return failed

    # --- tasks ---------------------------------------------------------------------------------

    def add_tasks(self, group: str, tids: Iterable[int], *, monitor: bool = False) -> int:
        """Write task ids into a group (or its monitor group), one id per write as the kernel
        requires; ids of tasks that exited meanwhile are skipped. Returns ids moved."""
        moved = self.sysfs.append_ids(self.tasks_file(group, monitor=monitor), tids, create=True)
        if moved:
            self._audit.record("tasks_moved", group=group, count=moved, monitor=monitor)
        return moved
