"""The state file a crashed or replaced agent leaves: what the next one does with a file it
cannot read, one that is empty or cut short, one of a version that keeps notes this one does
not know."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.host.statefile import STATE_FILE, state_file
from reconciler.loops.memory_guard import NOTES as GUARD_NOTES
from reconciler.mitigation.actions import TAINT_NOTES

NOBODY = 65534


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory anyone may write in (not sticky), so a process of another user can replace
    root's file in it but not read it."""
    directory = Path(tempfile.mkdtemp(prefix="nri-qos-state-"))
    directory.chmod(0o777)
    yield directory
    shutil.rmtree(directory)


def as_nobody(directory: Path) -> int:
    """Loads the state file as nobody and notes one value; the child's exit code (0: the file
    was said to be unreadable and the note kept in memory)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 4
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            notes = state_file(str(directory))
            noted = notes.remember(GUARD_NOTES, "/a", "max")
            code = 0 if notes.unreadable and noted and notes.entries(GUARD_NOTES) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to read as another user")
def test_a_file_that_cannot_be_read_is_not_replaced_by_the_next_note(open_dir: Path) -> None:
    path = open_dir / STATE_FILE
    earlier = {TAINT_NOTES: {"nri-qos.io/pressure": "NoSchedule"}}
    path.write_text(json.dumps(earlier))
    path.chmod(0o600)
    assert as_nobody(open_dir) == 0
    assert json.loads(path.read_text()) == earlier
    assert state_file(str(open_dir)).entries(TAINT_NOTES) == earlier[TAINT_NOTES]


LATER_NOTE = {"before": "max", "written": "1073741824"}
NEWER = {
    GUARD_NOTES: {"/sys/fs/cgroup/a/memory.max": "max", "/sys/fs/cgroup/b/memory.max": LATER_NOTE},
    "format": 2,
    "placed_elsewhere": [{"key": "example.com/x", "value": "NoSchedule"}],
}
"""A file of a later version: a note whose value is not a string, keys that are not sections."""


def test_notes_of_a_later_version_are_kept_on_disk_through_the_next_write(
        tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text(json.dumps(NEWER))
    notes = state_file(str(tmp_path))
    assert notes.entries(GUARD_NOTES) == {"/sys/fs/cgroup/a/memory.max": "max"}
    assert notes.unknown == {GUARD_NOTES: 1, "format": 1, "placed_elsewhere": 1}
    notes.put(TAINT_NOTES, "nri-qos.io/pressure", "NoSchedule")
    notes.forget(GUARD_NOTES, "/sys/fs/cgroup/a/memory.max")
    saved = json.loads((tmp_path / STATE_FILE).read_text())
    assert saved[GUARD_NOTES] == {"/sys/fs/cgroup/b/memory.max": LATER_NOTE}
    assert saved["format"] == 2
    assert saved["placed_elsewhere"] == NEWER["placed_elsewhere"]
    assert saved[TAINT_NOTES] == {"nri-qos.io/pressure": "NoSchedule"}


@pytest.mark.parametrize("content", [b"", b"\n", b'{"memory_guard": {"/sys/fs/cgroup/a": "ma',
                                     b"\x00" * 4096])
def test_an_empty_or_cut_short_file_is_set_aside_and_the_agent_starts_from_nothing(
        tmp_path: Path, content: bytes) -> None:
    """Not left by the agent's own writes (each is whole, fsynced and renamed into place), but
    by a disk or filesystem that lost the data: said, kept for a look, and no start refused."""
    (tmp_path / STATE_FILE).write_bytes(content)
    notes = state_file(str(tmp_path))
    assert notes.set_aside is not None
    assert notes.entries(GUARD_NOTES) == {}
    assert (tmp_path / f"{STATE_FILE}.bad").read_bytes() == content
    assert notes.remember(GUARD_NOTES, "/a", "max")
    assert state_file(str(tmp_path)).entries(GUARD_NOTES) == {"/a": "max"}


def test_a_note_reaches_the_disk_with_the_directory_that_names_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rename that puts a note in place is the directory's change: until the directory is
    synced, a power cut (a node that reboots under pressure) may bring the file back without
    the note, and the taint it records would stay on the node, noted nowhere."""
    synced: list[int] = []  # the inode of each directory synced, -1 for a file
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        what = os.fstat(fd)
        synced.append(what.st_ino if stat.S_ISDIR(what.st_mode) else -1)

    monkeypatch.setattr(os, "fsync", fsync)
    state_file(str(tmp_path)).put(TAINT_NOTES, "nri-qos.io/pressure", "NoSchedule")
    assert synced == [-1, os.stat(tmp_path).st_ino]  # the file's data, then its name
