"""The resctrl filesystem, rooted at a directory passed in (``/sys/fs/resctrl`` in production).

Everything that touches resctrl goes through :class:`ResctrlFs`: detection, control and monitor
groups, schemata and task ids. Every change is audited; schemata are written only when they
differ from what the kernel reports. Group names are validated again here, so no caller can
build a path outside the root.

On the real filesystem ``rmdir`` of a group removes its files and monitor groups in one go and
hands its tasks back to the root group; a plain directory tree (a copy of resctrl, tests) is
emptied first.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from hooks.resctrl import ResctrlInfo, Schemata, parse_schemata, valid_group_name
from nri_plugin.audit import AuditLog

# What the root schemata shows for MB under the mba_MBps mount option (MBA_MAX_MBPS, U32_MAX):
# values are then MB/s, which this layer does not manage.
_MBPS_MAX = (1 << 32) - 1
_NOT_GROUPS = frozenset({"info", "mon_groups", "mon_data"})


class ResctrlUnavailable(Exception):
    """resctrl is not mounted here, or offers nothing this plugin can use."""


class GroupError(Exception):
    """A group could not be created or configured; ``no_space`` when the kernel ran out of ids."""

    def __init__(self, group: str, reason: str, *, no_space: bool = False) -> None:
        super().__init__(f"{group}: {reason}")
        self.group = group
        self.no_space = no_space


def _read(path: Path) -> str:
    return path.read_text(encoding="ascii", errors="replace").strip()


def _read_int(path: Path, base: int = 10) -> int:
    return int(_read(path), base)


def read_info(root: Path, amd_mb_max: int) -> ResctrlInfo:
    """Describe the hardware from ``info/`` and the root ``schemata``; raise when unusable."""
    if not (root / "info").is_dir() or not (root / "schemata").is_file():
        raise ResctrlUnavailable(f"resctrl is not mounted at {root}")
    try:
        current = parse_schemata((root / "schemata").read_text(encoding="ascii"))
        l3_dir, mb_dir = root / "info" / "L3", root / "info" / "MB"
        closids: list[int] = []
        cbm_mask, min_bits = 0, 1
        l3_ids: tuple[int, ...] = ()
        if l3_dir.is_dir() and "L3" in current:
            cbm_mask = _read_int(l3_dir / "cbm_mask", 16)
            min_bits = _read_int(l3_dir / "min_cbm_bits")
            closids.append(_read_int(l3_dir / "num_closids"))
            l3_ids = tuple(sorted(current["L3"]))
        gran, mb_min, linear, absolute, mb_max = 10, 10, True, False, 100
        mb_ids: tuple[int, ...] = ()
        if mb_dir.is_dir() and "MB" in current:
            values = [int(v) for v in current["MB"].values()]
            if not any(v == _MBPS_MAX for v in values):
                gran = _read_int(mb_dir / "bandwidth_gran")
                mb_min = _read_int(mb_dir / "min_bandwidth")
                delay = mb_dir / "delay_linear"
                linear = _read_int(delay) == 1 if delay.exists() else True
                closids.append(_read_int(mb_dir / "num_closids"))
                mb_ids = tuple(sorted(current["MB"]))
                # Intel shows percent (the root group at 100); AMD absolute units above 100.
                absolute = any(v > 100 for v in values)
                mb_max = amd_mb_max if absolute else 100
    except (OSError, ValueError) as exc:
        raise ResctrlUnavailable(f"cannot read resctrl info under {root}: {exc}") from exc
    if not closids:
        raise ResctrlUnavailable(f"resctrl at {root} offers neither L3 nor MB allocation")
    return ResctrlInfo(
        num_closids=min(closids), cbm_mask=cbm_mask, min_cbm_bits=min_bits, l3_ids=l3_ids,
        mb_ids=mb_ids, mb_gran=gran, mb_min=mb_min, mb_delay_linear=linear,
        mb_absolute=absolute, mb_max=mb_max, monitoring=(root / "info" / "L3_MON").is_dir(),
    )


class ResctrlFs:
    """Groups, schemata and tasks under one resctrl mount."""

    def __init__(self, root: Path, info: ResctrlInfo, *, prefix: str, audit: AuditLog) -> None:
        self.root = root
        self._root_str = str(root)
        self.info = info
        self.prefix = prefix
        self._audit = audit
        # Budget check and mkdir must not interleave between two pods created concurrently.
        self._lock = threading.Lock()

    @classmethod
    def detect(cls, root: str | Path, *, prefix: str, audit: AuditLog, amd_mb_max: int,
               warn: Callable[[str], None]) -> ResctrlFs | None:
        """The filesystem, or None (after exactly one ``warn``) when resctrl cannot be used."""
        try:
            info = read_info(Path(root), amd_mb_max)
        except ResctrlUnavailable as exc:
            warn(f"resctrl disabled: {exc}")
            return None
        return cls(Path(root), info, prefix=prefix, audit=audit)

    # --- paths ---------------------------------------------------------------------------------

    def group_path(self, group: str) -> Path:
        if not valid_group_name(group):
            raise ValueError(f"invalid resctrl group name {group!r}")
        return self.root / group

    def monitor_path(self, group: str) -> Path:
        return self.group_path(group) / "mon_groups" / group

    # Called on every CreateContainer: plain os.path on strings, no Path objects.
    def has_group(self, group: str) -> bool:
        if not valid_group_name(group):
            raise ValueError(f"invalid resctrl group name {group!r}")
        return os.path.isdir(os.path.join(self._root_str, group))

    def has_monitor(self, group: str) -> bool:
        if not valid_group_name(group):
            raise ValueError(f"invalid resctrl group name {group!r}")
        return os.path.isdir(os.path.join(self._root_str, group, "mon_groups", group))

    def control_groups(self) -> list[str]:
        """Every control group below the root, ours or not (each holds a CLOS)."""
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return []
        return sorted(e.name for e in entries
                      if e.is_dir(follow_symlinks=False) and e.name not in _NOT_GROUPS)

    def our_groups(self) -> list[str]:
        """Control groups carrying this plugin's prefix (for garbage collection)."""
        return [g for g in self.control_groups()
                if g.startswith(self.prefix) and valid_group_name(g)]

    # --- schemata ------------------------------------------------------------------------------

    def read_schemata(self, group: str) -> dict[str, dict[int, str]]:
        return parse_schemata((self.group_path(group) / "schemata").read_text(encoding="ascii"))

    def ensure_group(self, group: str, schemata: Schemata, reason: str) -> bool:
        """Create ``group`` if needed and make its schemata match; True when anything changed."""
        path = self.group_path(group)
        created = False
        try:
            path.mkdir()
            created = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise GroupError(group, f"mkdir: {exc.strerror}",
                             no_space=exc.errno == errno.ENOSPC) from exc
        try:
            current = self.read_schemata(group) if not created else {}
        except OSError:
            current = {}
        if not created and schemata.matches(current):
            return False
        try:
            _write(path / "schemata", schemata.text())
        except OSError as exc:
            if created:
                self._rmdir(path)
            raise GroupError(group, f"schemata {schemata.lines()}: {exc.strerror}") from exc
        self._audit.record("resctrl_group_created", group=group,
                           schemata=list(schemata.lines()), reason=reason, created=created)
        return True

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
        path = self.monitor_path(group)
        try:
            # The kernel provides mon_groups in every control group; a plain tree lacks it.
            path.parent.mkdir(exist_ok=True)
            path.mkdir()
        except FileExistsError:
            return True
        except OSError:
            return False
        return True

    def remove_group(self, group: str, reason: str) -> bool:
        """Remove a control group with its monitor groups; False when it did not exist."""
        path = self.group_path(group)
        if not path.is_dir():
            return False
        self._rmdir(path)
        self._audit.record("resctrl_group_removed", group=group, reason=reason)
        return True

    def _rmdir(self, path: Path) -> None:
        try:
            path.rmdir()
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        for dirpath, dirnames, filenames in os.walk(path, topdown=False):
            for name in filenames:
                os.unlink(os.path.join(dirpath, name))
            for name in dirnames:
                os.rmdir(os.path.join(dirpath, name))
        path.rmdir()

    # --- tasks ---------------------------------------------------------------------------------

    def _tasks_path(self, group: str, monitor: bool) -> Path:
        return (self.monitor_path(group) if monitor else self.group_path(group)) / "tasks"

    def add_tasks(self, group: str, tids: Iterable[int], *, monitor: bool = False) -> int:
        """Write task ids into a group (or its monitor group), one id per write as the kernel
        requires; ids of tasks that exited meanwhile (ESRCH) are skipped. Returns ids moved."""
        moved = 0
        fd = os.open(self._tasks_path(group, monitor), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                     0o644)
        try:
            for tid in tids:
                if tid <= 0:
                    continue
                try:
                    os.write(fd, f"{tid}\n".encode())
                except ProcessLookupError:
                    continue
                moved += 1
        finally:
            os.close(fd)
        if moved:
            self._audit.record("tasks_moved", group=group, count=moved, monitor=monitor)
        return moved

    def read_tasks(self, group: str, *, monitor: bool = False) -> set[int]:
        text = self._tasks_path(group, monitor).read_text(encoding="ascii")
        return {int(t) for t in text.split() if t.isdigit()}


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)
