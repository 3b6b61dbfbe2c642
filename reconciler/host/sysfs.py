"""The one layer that reads and writes ``/sys`` and ``/proc``, always below a root directory.

Callers name files by their system path (``/sys/fs/cgroup/memory/kubepods/...``,
``/proc/42/oom_score_adj``); :class:`SysFs` maps them below its root, so the same code runs on the
host (root ``/``), in a container that mounts the host at ``/host``, and on a file tree built by a
test under a temporary directory.

Writes are idempotent and audited: :meth:`SysFs.write_if_changed` reads the file first and writes
only when the value differs (one ``cgroup_write`` audit record per write actually done). Errors are
classified once, here:

* ``ENOENT`` (and ``ENODEV``): the container or process went away between listing and writing.
  Expected during churn, so only a debug log; the outcome is :attr:`Outcome.GONE`.
* ``ESRCH``: a task id that exited; tolerated the same way.
* ``EBUSY`` / ``EINVAL``: the kernel refused for now (a memory limit below usage that reclaim has
  not made room for yet, a cpuset that races a parent update). Retried with exponential backoff up
  to ``retries`` attempts, then one ``cgroup_write_failed`` audit record.
* ``EROFS``: the tree is mounted read-only (a container given ``/sys/fs/cgroup`` or ``/proc``
  read-only). Every write would fail the same way, so it is said once: one ``sysfs_read_only``
  error line naming the fix and one ``cgroup_write_failed`` record; later writes refused so are
  only counted, until a write succeeds again (the tree was remounted) and the next refusal is
  said again.
* anything else (``EACCES``, ``EPERM``, ``ENOSPC`` ...): no retry, ``cgroup_write_failed``. A
  loop asks again every cycle: a file's refusals are said when they start or change errno, then
  only counted, until a write to it is taken again (:class:`~.held_writes.Refusals`).

Observe mode (``observe`` returns True): every write is decided as usual but not done; it is
counted as :attr:`Outcome.OBSERVED` and audited as ``write_observed``, once per file and value
(task ids: once per file), since a loop decides it again every cycle while the file stays so.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from pathlib import Path

import structlog

from common.audit import AuditLog
from common.metrics import Metrics
from hooks.untrusted import bounded, bounded_repr
from reconciler.host.children import MOVER, SYS_MOVE_PAGES, WRITER, Children
from reconciler.host.held_writes import HeldWrites, Refusals
from reconciler.host.parse import errno_text
from reconciler.host.values import PAGE_SIZE, Comparator, same_text

log = structlog.get_logger("nri_qos.sysfs")

_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENODEV, errno.ESRCH})
_RETRY_ERRNOS = frozenset({errno.EBUSY, errno.EINVAL})


class Outcome(Enum):
    UNCHANGED = "unchanged"
    WRITTEN = "written"
    GONE = "gone"
    FAILED = "failed"
    TIMEOUT = "timeout"
    OBSERVED = "observed"


def short_reclaim(outcome: Outcome, error: str) -> bool:
    """A bounded write to cgroup v2's ``memory.reclaim`` that the kernel answered with EAGAIN:
    it reclaimed less than the amount written, a short reclaim and not a fault."""
    return outcome is Outcome.FAILED and error.startswith(errno.errorcode[errno.EAGAIN])


class SysPathError(ValueError):
    """A system path that is not absolute or tries to leave its tree."""


def check_sys_path(path: str) -> str:
    """Reject anything but a plain absolute path: no ``..`` or ``.`` parts (nor any part starting
    with a dot: no kernel file does), no empty parts, no NUL. Substring tests only, as this runs
    for every file the loops touch."""
    if (not path.startswith("/") or "/." in path or "//" in path or "\0" in path
            or (path.endswith("/") and path != "/")):
        raise SysPathError(f"not a plain absolute path: {bounded_repr(path)}")
    return path


def read_file_bytes(real: str) -> bytes | None:
    """A whole file through raw descriptors (cheaper than a text file object); None when gone.

    Reads until ``read()`` returns nothing: a short read is not the end of a kernel file. A
    seq_file (``/proc/zoneinfo``, ``/proc/vmstat``, ``memory.stat``) hands out whole records one
    buffer at a time, so its first read can stop at any record boundary; on a two-socket server
    ``/proc/zoneinfo`` is tens of KiB and every zone past the first buffer would be lost.
    """
    try:
        fd = os.open(real, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in _GONE_ERRNOS:
            return None
        raise
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        if exc.errno in _GONE_ERRNOS:
            return None
        raise
    finally:
        os.close(fd)


def read_id_file(real: str) -> list[int] | None:
    """Integers, one per line, from a file given by its real path; ``None`` when it is gone."""
    data = read_file_bytes(real)
    if data is None:
        return None
    return [int(x) for x in data.split()]


class SysReader:
    """Reads system files below ``root`` (missing files, processes and cgroups read as
    ``None`` or empty), and arms the kernel's notifications on them."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)
        self._prefix = str(self.root).rstrip("/")

    def real(self, path: str) -> str:
        """Where the system path ``path`` is below the root."""
        return self._prefix + check_sys_path(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(self.real(path))

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(self.real(path))

    def read(self, path: str) -> str | None:
        """The file's text, or ``None`` when it (or its process/cgroup) is gone."""
        data = read_file_bytes(self.real(path))
        return None if data is None else data.decode("ascii", errors="replace")

    def read_int(self, path: str) -> int | None:
        text = self.read(path)
        if text is None:
            return None
        try:
            return int(text.strip())
        except ValueError:
            return None

    def read_ids(self, path: str) -> list[int] | None:
        """A ``tasks`` / ``cgroup.procs`` / ``cgroup.threads`` file; ``None`` when gone.

        The hot path of the task-id loop: ``path`` must come from already validated parts
        (:mod:`reconciler.host.cgroups` checks every component), so it is not checked again here.
        """
        return read_id_file(self._prefix + path)

    def read_bytes(self, path: str) -> bytes | None:
        """The file's bytes, or ``None`` when it is gone."""
        return read_file_bytes(self.real(path))

    def list_dir(self, path: str) -> list[str]:
        """Entry names of a directory; empty when it does not exist."""
        try:
            return os.listdir(self.real(path))
        except OSError as exc:
            if exc.errno in _GONE_ERRNOS or exc.errno == errno.ENOTDIR:
                return []
            raise

    def list_subdirs(self, path: str) -> list[str]:
        """Names of the directories in a directory (symlinks not followed); empty when it does
        not exist or cannot be read."""
        try:
            with os.scandir(self.real(path)) as entries:
                return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
        except OSError:
            return []

    def open_trigger(self, path: str, spec: str) -> int:
        """Arm a PSI trigger (``some 150000 1000000``) on a pressure file; the open descriptor,
        which signals POLLPRI when the trigger fires and disarms it when closed. Raises
        :class:`OSError` when the kernel refuses (EINVAL for a window it does not accept,
        EPERM without the privilege some kernels require)."""
        fd = os.open(self.real(path), os.O_RDWR | os.O_NONBLOCK)
        try:
            os.write(fd, spec.encode("ascii") + b"\0")
        except OSError:
            os.close(fd)
            raise
        return fd

    def register_memcg_event(self, cgroup: str, file: str, args: str) -> int:
        """Ask the kernel (cgroup v1) to signal an eventfd on a memcg event: ``file`` names the
        event in ``cgroup`` (``memory.pressure_level``, ``memory.oom_control`` ...) and
        ``args`` is what that file takes (``low,local``). Returns the eventfd (non-blocking;
        reading it returns the count of events since the last read); closing it ends the
        registration. The kernel also signals it once when the cgroup is removed. Raises
        :class:`OSError` when refused."""
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            # The kernel keeps its own reference to the event file: it may be closed at once.
            target = os.open(self.real(f"{cgroup}/{file}"), os.O_RDONLY | os.O_CLOEXEC)
            try:
                control = os.open(self.real(f"{cgroup}/cgroup.event_control"),
                                  os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.write(control, f"{efd} {target} {args}".encode("ascii"))
                finally:
                    os.close(control)
            finally:
                os.close(target)
        except OSError:
            os.close(efd)
            raise
        return efd


class SysFs(SysReader):
    """Reads and writes system files below ``root``; see the module doc for the error policy."""

    def __init__(
        self,
        root: str | os.PathLike[str] = "/",
        audit: AuditLog | None = None,
        *,
        retries: int = 3,
        backoff_s: float = 0.01,
        sleep: Callable[[float], None] = time.sleep,
        metrics: Metrics | None = None,
        observe: Callable[[], bool] | None = None,
        children: Children | None = None,
        refused: Refusals | None = None,
    ) -> None:
        if retries < 1:
            raise ValueError("retries must be at least 1")
        super().__init__(root)
        self._audit = audit
        self._retries = retries
        self._backoff_s = backoff_s
        self._sleep = sleep
        self._metrics = metrics
        self._observe = observe
        self._observed = HeldWrites()  # the value last audited per file in observe mode
        # A write was refused with EROFS and said so; cleared by the next write that succeeds.
        self._read_only_said = False
        # Children doing long kernel work, shared with every view made from this one.
        self._children = Children() if children is None else children
        self._refused = Refusals() if refused is None else refused  # shared by every view

    def metered(self, metrics: Metrics) -> SysFs:
        """The same tree and write policy, counting every write into ``metrics``."""
        return SysFs(self.root, self._audit, retries=self._retries, backoff_s=self._backoff_s,
                     sleep=self._sleep, metrics=metrics, observe=self._observe,
                     children=self._children, refused=self._refused)

    def observing(self, observe: Callable[[], bool]) -> SysFs:
        """The same tree and write policy, writing nothing while ``observe()`` is true."""
        return SysFs(self.root, self._audit, retries=self._retries, backoff_s=self._backoff_s,
                     sleep=self._sleep, metrics=self._metrics, observe=observe,
                     children=self._children, refused=self._refused)

    def held(self) -> bool:
        """Whether writes are held back now (observe mode)."""
        return self._observe is not None and self._observe()

    def unobserved(self) -> SysFs:
        """The same tree and write policy, never held back by observe mode: for undoing what
        the agent changed, which returns the node to what it was (an enforcing run's cap must
        go when the node is switched to observe, or when an observing agent finds it)."""
        return SysFs(self.root, self._audit, retries=self._retries, backoff_s=self._backoff_s,
                     sleep=self._sleep, metrics=self._metrics, children=self._children,
                     refused=self._refused)

    def _observed_only(self, path: str, value: str, reason: str, count: int = 1,
                       kept: str | None = None) -> bool:
        """True (after counting and, once per file and value, auditing) when the write is
        held back by observe mode; ``kept``: remembered instead of the value, said once."""
        if self._observe is None or not self._observe():
            return False
        shown = bounded(value.strip())
        if self._observed.news(path, shown if kept is None else kept):
            self._record("write_observed", path=path, value=shown, reason=reason)
        self._count(path, Outcome.OBSERVED, count)
        return True

    def make_dir(self, path: str) -> bool:
        """Create a directory (a cgroup or resctrl group); False when it already existed."""
        try:
            os.mkdir(self.real(path))
        except FileExistsError:
            return False
        return True

    def remove_dir(self, path: str) -> bool:
        """Remove a directory; False when it did not exist.

        On cgroupfs and resctrl one ``rmdir`` removes a group with its files and sub-groups
        (the kernel hands the tasks back to the parent); a plain directory tree standing in for
        one is emptied first.
        """
        real = self.real(path)
        try:
            os.rmdir(real)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        for dirpath, dirnames, filenames in os.walk(real, topdown=False):
            for name in filenames:
                os.unlink(os.path.join(dirpath, name))
            for name in dirnames:
                os.rmdir(os.path.join(dirpath, name))
        os.rmdir(real)
        return True

    def write_bounded(self, path: str, value: str, timeout_s: float,
                      nice: int = 0) -> tuple[Outcome, str]:
        """Write ``value`` from a child process that is killed after ``timeout_s``
        (:mod:`reconciler.host.children`): for writes that make the kernel work for long
        (``memory.force_empty``, ``memory.reclaim``). The kernel's work is done in the
        writer's context, so ``nice`` (added to the agent's niceness) is the priority it
        reclaims at. Not audited here: the caller records the action.

        Returns the outcome (WRITTEN, GONE, FAILED, TIMEOUT or OBSERVED) and, unless written,
        why."""
        if self._observed_only(path, value, "bounded write"):
            return Outcome.OBSERVED, "observe mode: not written"
        code, _, why = self._children.run(
            WRITER, [self.real(path), value, str(os.getpid()), str(nice)], timeout_s, "writer")
        outcome = (Outcome.TIMEOUT if code is None else Outcome.WRITTEN if code == 0
                   else Outcome.GONE if code in _GONE_ERRNOS else Outcome.FAILED)
        # A short reclaim is the kernel's answer to the amount asked, not a refused write.
        self._count(path, Outcome.WRITTEN if short_reclaim(outcome, why) else outcome)
        return outcome, why

    def move_pages_bounded(self, pids: Sequence[int], hot: int, cool: int, budget_bytes: int,
                           timeout_s: float) -> tuple[Outcome, int, str]:
        """Move at most ``budget_bytes`` of the processes' pages from NUMA node ``hot`` to
        ``cool`` from a child process killed after ``timeout_s`` (pages moved until then stay
        moved). Not audited here: the caller records the step.

        Returns the outcome (WRITTEN, FAILED, TIMEOUT or OBSERVED), the bytes the kernel said
        it moved (0 when the child was killed: its count is lost with it) and, unless done,
        why."""
        what = f"{budget_bytes} bytes of {' '.join(map(str, pids))} from node {hot} to {cool}"
        if self._observed_only(f"/proc/{pids[0] if pids else 0}/move_pages", what,
                               "NUMA balance step"):
            return Outcome.OBSERVED, 0, "observe mode: nothing moved"
        number = SYS_MOVE_PAGES.get(os.uname().machine)
        if number is None:
            return Outcome.FAILED, 0, f"move_pages(2) unknown on {os.uname().machine}"
        argv = [str(os.getpid()), self.real("/proc"), str(hot), str(cool),
                str(budget_bytes // PAGE_SIZE), str(PAGE_SIZE), str(number),
                *map(str, pids)]
        code, out, why = self._children.run(MOVER, argv, timeout_s, "child")
        moved = int(out) * PAGE_SIZE if out.strip().isdigit() else 0
        outcome = (Outcome.TIMEOUT if code is None else Outcome.WRITTEN if code == 0
                   else Outcome.FAILED)
        self._count(f"/proc/{pids[0] if pids else 0}/move_pages", outcome)
        return outcome, moved, why

    def kill_writers(self) -> int:
        """The agent stops: kills every child writer still running (the kernel stops its
        reclaim) instead of waiting for it, and starts no new one; how many were killed."""
        return self._children.stop()

    def append_ids(self, path: str, ids: Iterable[int], *, create: bool = False) -> int:
        """Write task ids into a ``tasks``-like file, one id per write as the kernel requires;
        ids of tasks that exited meanwhile (ESRCH) are skipped. Returns the ids written.

        ``create``: the file belongs to a group this process made, which the kernel fills with
        its files; a plain directory tree standing in for it needs the file created.
        """
        ids = [tid for tid in ids if tid > 0]
        # The ids change with every process started: the moves into a group are news once.
        if ids and self._observed_only(path, " ".join(map(str, ids)), "task ids", len(ids),
                                       kept="task ids"):
            return 0
        flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.real(path), flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.EROFS:
                self._refused_read_only(path, "task ids", "moving tasks into their group")
                self._count(path, Outcome.FAILED)
            raise
        written = 0
        try:
            for tid in ids:
                try:
                    os.write(fd, b"%d\n" % tid)
                except ProcessLookupError:
                    self._count(path, Outcome.GONE)
                    continue
                written += 1
        finally:
            os.close(fd)
            if written:
                self._count(path, Outcome.WRITTEN, written)
        return written

    # -- writing ---------------------------------------------------------------------------------

    def write_if_changed(
        self, path: str, value: str, reason: str, *, same: Comparator = same_text
    ) -> Outcome:
        """Write ``value`` unless the file already holds an equal one (by ``same``)."""
        return self.write_if_changed_why(path, value, reason, same=same)[0]

    def write_if_changed_why(
        self, path: str, value: str, reason: str, *, same: Comparator = same_text
    ) -> tuple[Outcome, str]:
        """As :meth:`write_if_changed`, and why a write failed ("" otherwise), the errno's name
        first (``ENOSPC: No space left on device``): for a caller whose next step depends on
        which refusal it was."""
        current = self.read(path)
        if current is None:
            log.debug("write_skipped", reason="file gone", path=path)
            return self._count(path, Outcome.GONE), ""
        if same(current, value):
            self._refused.ended(path)
            return self._count(path, Outcome.UNCHANGED), ""
        return self._write(path, value, reason, False)

    def write(self, path: str, value: str, reason: str, *, create: bool = False) -> Outcome:
        """Write unconditionally, with the retry policy; one audit record when it succeeds.

        ``create`` as for :meth:`append_ids`.
        """
        return self._write(path, value, reason, create)[0]

    def _write(self, path: str, value: str, reason: str, create: bool) -> tuple[Outcome, str]:
        real = self.real(path)
        if self._observed_only(path, value, reason):
            return Outcome.OBSERVED, ""
        data = value.encode("ascii")
        attempt = 0
        while True:
            attempt += 1
            try:
                self._write_once(real, data, create)
            except OSError as exc:
                if exc.errno in _GONE_ERRNOS:
                    log.debug("write_skipped", reason="target gone", path=path,
                              error=exc.strerror)
                    return self._count(path, Outcome.GONE), ""
                if exc.errno in _RETRY_ERRNOS and attempt < self._retries:
                    self._sleep(self._backoff_s * (2 ** (attempt - 1)))
                    continue
                why = errno_text(exc)
                if exc.errno == errno.EROFS:
                    self._refused_read_only(path, value, reason)
                elif self._refused.news(path, why):
                    self._record("cgroup_write_failed", path=path, value=value.strip(),
                                 reason=reason, error=f"{why} (attempt {attempt})")
                return self._count(path, Outcome.FAILED), why
            self._read_only_said = False
            self._refused.ended(path)
            self._record("cgroup_write", path=path, value=value.strip(), reason=reason)
            return self._count(path, Outcome.WRITTEN), ""

    def _refused_read_only(self, path: str, value: str, reason: str) -> None:
        """A write refused because the tree is read-only: said the first time only."""
        if self._read_only_said:
            return
        self._read_only_said = True
        log.error("sysfs_read_only", path=path, root=str(self.root),
                  hint="the agent writes cgroup, resctrl and /proc files: give it the host's "
                       "/sys/fs/cgroup, /sys/fs/resctrl and /proc read-write")
        self._record("cgroup_write_failed", path=path, value=bounded(value.strip()),
                     reason=reason, error="EROFS: Read-only file system (said once; later "
                                          "writes refused so are only counted)")

    @staticmethod
    def _write_once(real: str, data: bytes, create: bool) -> None:
        # No O_CREAT unless asked: cgroup and proc files exist or their cgroup/process is gone,
        # and a file tree built by a test must report that the same way (ENOENT). O_TRUNC is
        # ignored by the kernel's files and makes a plain file hold exactly the value written.
        fd = os.open(real, os.O_WRONLY | os.O_TRUNC | (os.O_CREAT if create else 0), 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _count(self, path: str, outcome: Outcome, count: int = 1) -> Outcome:
        if self._metrics is not None:
            self._metrics.host_write(path, outcome.value, count)
        return outcome

    def _record(self, event: str, **fields: object) -> None:
        if event == "cgroup_write_failed":
            log.warning("write_failed", **fields)
        if self._audit is not None:
            self._audit.record(event, **fields)
