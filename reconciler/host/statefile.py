"""What the agent changed on the node and must put back, kept in a small file across restarts.

An effect the agent undoes later (the memory guard's cap on the offline tier, a tuned
``memory.wmark_ratio``, a node taint) is noted here before it is made, with what to restore: the
file's value before the agent first wrote it, or the taint's key. The note goes when the effect
has been undone. After a crash, a restart, or for ``nri-qos reset`` on an uninstalled node, the
file says what to undo, whatever the configuration says now. Drift also keeps here what it needs
to give values back after a restart (its notes of container files, kubelet's values), replaced
whole (:meth:`StateFile.replace`).

The file is one JSON object of sections, each mapping a key (a system path, a taint key) to a
string, and the boot that wrote it (:data:`BOOT_KEY`); it is written whole to a temporary file
and renamed over the old one, so a crash leaves the old or the new file, never half of one. A
file that is malformed or larger than :data:`MAX_FILE_BYTES` is set aside (renamed ``*.bad``)
and the agent starts from nothing: it cannot restore what it cannot read, and must not fail to
start for it. One that cannot be read (an I/O error, a denial) is left where it is and never
written over: the notes of the run that found it live in memory only, and a later start or
``nri-qos reset`` reads it once it can. Without a directory (``path`` None) the notes live in
memory only. Safe from any thread.

A reboot rebuilds what the notes of :data:`BOOT_BOUND` are about: kubelet makes the cgroups
again with its own values, the containers are new. Those notes, when the file names another
boot, are dropped at load (``state_notes_of_an_earlier_boot``): a value from before the agent's
write in an earlier boot is not what the new boot's cgroup had, and writing it back would
change the node. The notes of the API server's objects (a taint, a node condition) and of
resctrl's group prefixes stay: those outlive a reboot. A file that names no boot (written by an
earlier version) keeps every note, since dropping one of this boot would leave its effect for
good.

A write ends with an fsync, which under heavy writeback (memory pressure, exactly when the ladder
acts) can take seconds. The notes' lock is never held across one: reading the notes never waits
for the disk. The event loop writes through :meth:`StateFile.put_in_thread` and
:meth:`StateFile.forget_in_thread`, on the ``writer`` executor the agent hands in, and awaits them:
a note is still on disk before the effect it records is made, while the NRI answers go on.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import json
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor

import structlog

from common import jsondoc
from reconciler.host.sysfs import Outcome, SysFs

log = structlog.get_logger("nri_qos.state")

STATE_FILE = "state.json"
MAX_FILE_BYTES = 32 << 20
"""Above what the file holds at its limits: :data:`MAX_ENTRIES` notes, a path of kubelet's
systemd driver (about 200 bytes) each, with drift's and kubelet's notes of as many containers as
they keep, is 9.8 MB (``tests/host/test_boot_statefile_limits.py``); a file the agent wrote and
the next start set aside as too large would lose every note. A node's notes are usually a few
hundred."""
MAX_ENTRIES = 32768
"""Notes kept at most: eight per pod at the node state's pod limit (4096), for a pod's protection
files with the agent's last write to each, its NUMA files and its tuned files. Beyond it a new
note is refused and the effect is not made (the caller's choice), rather than made and
forgotten."""
BOOT_ID = "/proc/sys/kernel/random/boot_id"
"""The kernel's id of this boot (the same in every container of the node)."""
BOOT_KEY = "boot_id"
"""The file's key of the boot that wrote it: a string where each section is an object, so a
version that does not know it passes it over (and writes the file without it: the next load
then keeps every note)."""
BOOT_BOUND = frozenset({"memory_guard", "cpu_idle", "numa_binding", "numa_balance", "protection",
                        "protection_written", "wmark_ratio", "container_values", "kubelet"})
"""The sections of notes about cgroup files and containers, which a reboot rebuilds."""
STOP_WAIT_S = 2.0
"""How long a caller cancelled while its write is on the writer still waits for that write: the
stop path's own writes then come after it, and a disk that hangs does not hold the stop for
good."""


class StateFile:
    """``read_only``: the file is read and never changed, an invalid one not set aside (what
    ``nri-qos reset --dry-run`` needs: it changes nothing on the node). ``writer``: where the
    ``*_in_thread`` methods write (one thread keeps the writes in the order they were asked
    for); without one they write in the caller's thread."""

    def __init__(self, path: str | None, *, read_only: bool = False,
                 writer: Executor | None = None, boot: str | None = None) -> None:
        """``boot``: this boot's id (:func:`boot_id`; None: not known, and no note is taken
        for an earlier boot's)."""
        self.path = path
        self._read_only = read_only
        self._writer = writer
        self._lock = threading.Lock()  # the notes in memory
        self._file_lock = threading.Lock()  # the file; never taken with the notes' lock held
        # Held by a loop from its look at another section's notes about a file to its write of
        # that file, so the owner of those notes cannot give the file back in between and
        # leave the write noted nowhere.
        self.handover = threading.RLock()
        self._changes = 0  # changes made to the notes (under the notes' lock)
        self._saved = 0  # the latest change the file holds (under the file's lock)
        # Why the notes could not be read, for a caller that must not take "no notes" for
        # "nothing to undo": the file is left where it is, or was set aside as invalid.
        self.unreadable: str | None = None
        self.set_aside: str | None = None
        # Why the latest write failed (None once one succeeds): the file holds older notes.
        self.unwritable: str | None = None
        # The notes dropped at load as an earlier boot's, by section.
        self.of_earlier_boot: dict[str, int] = {}
        # What a later version noted in a shape this one does not know (a value that is not a
        # string, a key that is not a section), by section: not undone by this version, but
        # written back with every write, so the version that knows it still finds it.
        self.unknown: dict[str, int] = {}
        self._foreign: dict[str, object] = {}
        self._boot = boot if path is not None else None
        self._sections: dict[str, dict[str, str]] = self._load()

    def _load(self) -> dict[str, dict[str, str]]:
        if self.path is None:
            return {}
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            # Left where it is and never written over: a later start, or the reset, may read
            # what it notes (an I/O error that passes, a denial lifted). This run's notes then
            # live in memory only.
            log.error("state_file_unreadable", path=self.path, error=str(exc),
                      notes="kept in memory only, the file left as it is")
            self.unreadable = str(exc)
            return {}
        try:
            if len(raw) > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            doc = jsondoc.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            sections = {name: {k: v for k, v in entries.items() if isinstance(v, str)}
                        for name, entries in doc.items()
                        if isinstance(entries, dict) and name != BOOT_KEY}
        except ValueError as exc:
            self.set_aside = str(exc)
            if self._read_only:
                log.error("state_file_invalid", path=self.path, error=str(exc))
                return {}
            log.error("state_file_invalid", path=self.path, error=str(exc),
                      kept_as=f"{self.path}.bad")
            try:
                os.replace(self.path, f"{self.path}.bad")
            except OSError as move:
                log.warning("state_file_unmovable", path=self.path, error=str(move))
            return {}
        written_in = doc.get(BOOT_KEY)
        if isinstance(written_in, str) and self._boot is not None and written_in != self._boot:
            self.of_earlier_boot = {name: len(sections.pop(name)) for name in sorted(BOOT_BOUND)
                                    if sections.get(name)}
            if self.of_earlier_boot:
                log.warning("state_notes_of_an_earlier_boot", path=self.path, boot=written_in,
                            dropped=self.of_earlier_boot, kept=sorted(sections))
            doc = {name: value for name, value in doc.items() if name not in BOOT_BOUND}
        self._keep_foreign(doc)
        return sections

    def _keep_foreign(self, doc: dict[str, object]) -> None:
        for name, value in doc.items():
            if name == BOOT_KEY:
                continue
            if not isinstance(value, dict):
                self._foreign[name] = value
                self.unknown[name] = 1
                continue
            odd = {key: entry for key, entry in value.items() if not isinstance(entry, str)}
            if odd:
                self._foreign[name] = odd
                self.unknown[name] = len(odd)
        if self.unknown:
            log.warning("state_notes_unknown", path=self.path, notes=self.unknown,
                        kept="written back as they are, not undone by this version")

    def _document(self, sections: dict[str, dict[str, str]]) -> dict[str, object]:
        """What the file holds: the notes, what a later version noted beside them, the boot."""
        doc: dict[str, object] = dict(sections)
        for name, value in self._foreign.items():
            if isinstance(value, dict):
                doc[name] = {**value, **sections.get(name, {})}
            else:
                doc.setdefault(name, value)
        if self._boot:
            doc[BOOT_KEY] = self._boot
        return doc

    def entries(self, section: str) -> Mapping[str, str]:
        """A copy of the section's notes."""
        with self._lock:
            return dict(self._sections.get(section, {}))

    def remember(self, section: str, key: str, value: str) -> bool:
        """Notes ``value`` for ``key`` unless a note is there already (the first one is what
        to restore). False when the note could not be kept (:data:`MAX_ENTRIES`): the caller
        should not make the effect. A file that cannot be written is logged and the note kept
        in memory: this run still restores it."""
        with self._lock:
            entries = self._sections.setdefault(section, {})
            if key in entries:
                return True
            if sum(len(e) for e in self._sections.values()) >= MAX_ENTRIES:
                log.warning("state_file_full", section=section, limit=MAX_ENTRIES)
                return False
            entries[key] = value
            change = self._changed()
        self._save(*change)
        return True

    def put(self, section: str, key: str, value: str) -> None:
        """Notes ``value`` for ``key``, replacing an earlier note."""
        with self._lock:
            entries = self._sections.setdefault(section, {})
            if entries.get(key) == value:
                return
            entries[key] = value
            change = self._changed()
        self._save(*change)

    def replace(self, section: str, entries: Mapping[str, str]) -> None:
        """Replaces the section's notes with ``entries``, in one write (none when they are the
        same). For a section that mirrors a view kept elsewhere, not for effects to undo: the
        caller bounds how many ``entries`` there are."""
        with self._lock:
            if self._sections.get(section, {}) == entries:
                return
            if entries:
                self._sections[section] = dict(entries)
            else:
                self._sections.pop(section, None)
            change = self._changed()
        self._save(*change)

    def forget(self, section: str, key: str) -> None:
        with self._lock:
            entries = self._sections.get(section)
            if entries is None or key not in entries:
                return
            del entries[key]
            if not entries:
                del self._sections[section]
            change = self._changed()
        self._save(*change)

    async def put_in_thread(self, section: str, key: str, value: str) -> None:
        """:meth:`put` on the writer, awaited: the note is on disk when this returns."""
        await self._off_loop(lambda: self.put(section, key, value))

    async def forget_in_thread(self, section: str, key: str) -> None:
        """:meth:`forget` on the writer, awaited."""
        await self._off_loop(lambda: self.forget(section, key))

    async def _off_loop(self, write: Callable[[], None]) -> None:
        if self._writer is None:
            write()
            return
        context = contextvars.copy_context()  # the log context goes along
        done = asyncio.get_running_loop().run_in_executor(self._writer, context.run, write)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            # Stopping: the write handed over still ends first (see STOP_WAIT_S).
            await asyncio.wait({done}, timeout=STOP_WAIT_S)
            raise

    def _writes(self) -> bool:
        return self.path is not None and not self._read_only and self.unreadable is None

    def _changed(self) -> tuple[int, dict[str, dict[str, str]]]:
        """The number of this change and a copy of the notes to write (notes' lock held)."""
        self._changes += 1
        if not self._writes():
            return self._changes, {}
        return self._changes, {name: dict(entries) for name, entries in self._sections.items()}

    def _save(self, change: int, sections: dict[str, dict[str, str]]) -> None:
        """Writes the whole file as of ``change``, unless a later change is on disk already
        (written by another thread meanwhile, with this one in it)."""
        if self.path is None or not self._writes():
            return
        with self._file_lock:
            if change <= self._saved:
                return
            tmp = f"{self.path}.tmp"
            directory = os.path.dirname(self.path) or "."
            try:
                os.makedirs(directory, mode=0o700, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(self._document(sections), f, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
                # The rename is the directory's change: synced too, or a power cut may bring
                # back the file without this note while the effect it records outlives the
                # boot (a taint, a node condition).
                dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            except OSError as exc:
                log.error("state_file_unwritable", path=self.path, error=str(exc))
                self.unwritable = str(exc)
                return
            self.unwritable = None
            self._saved = change


def boot_id(sysfs: SysFs) -> str | None:
    """This boot's id, as the host's kernel says it; None where it does not."""
    text = sysfs.read(BOOT_ID)
    return text.strip() or None if text is not None else None


def state_file(directory: str, *, read_only: bool = False, writer: Executor | None = None,
               boot: str | None = None) -> StateFile:
    """The agent's state file in ``directory`` (memory only when it is empty); ``boot``: this
    boot's id (:func:`boot_id`)."""
    return StateFile(os.path.join(directory, STATE_FILE) if directory else None,
                     read_only=read_only, writer=writer, boot=boot)


Resolver = Callable[[SysFs, str, str], str]
"""What a note is written back as: (the tree, the file's path, its noted value) -> the value."""


def restore_noted(sysfs: SysFs, notes: StateFile, section: str, reason: str,
                  under: str = "", *, resolve: Resolver | None = None) -> int:
    """Writes back every file noted in ``section`` (only those whose path starts with
    ``under``; never held back by observe mode: undoing returns the node to what it was),
    forgetting each one restored or gone (a container gone meanwhile has nothing to restore);
    how many were written. ``resolve`` gives what a note is written back as, where that is not
    the noted value itself (what an empty ``cpuset.mems`` stands for).

    An empty note the kernel refuses with ENOSPC (an empty ``cpuset.mems`` to a cgroup with
    processes) would be refused at every try: it is dropped, and said
    (``restore_abandoned``)."""
    restored = 0
    sysfs = sysfs.unobserved()
    for path, value in notes.entries(section).items():
        if not path.startswith(under):
            continue
        wanted = value if resolve is None else resolve(sysfs, path, value)
        # Only the NUMA sections note a file that can be empty (cpuset.mems; their resolver
        # turns an empty note into the parent's nodes where it can read them); the files the
        # other sections note (memory.*, cpu.idle, memory.wmark_ratio, memory_migrate) always
        # hold a value. A write of no bytes never reaches the kernel: an empty value goes as a
        # newline, which cgroup files read as empty.
        outcome, why = sysfs.write_if_changed_why(path, wanted or "\n", reason)
        restored += outcome is Outcome.WRITTEN
        if outcome is Outcome.FAILED:
            if value or not why.startswith(f"{errno.errorcode[errno.ENOSPC]}:"):
                continue
            log.warning("restore_abandoned", section=section, path=path, value=wanted,
                        error=why, reason=reason)
        notes.forget(section, path)
    return restored
