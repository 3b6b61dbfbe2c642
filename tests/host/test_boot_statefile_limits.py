"""The state file at every limit of what it keeps reads back whole: a file the agent writes and the
next start sets aside as too large would lose every note, the taint's and the tier's included."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from reconciler.host import statefile
from reconciler.host.statefile import STATE_FILE, StateFile
from reconciler.loops.container_values import MAX_KEPT
from reconciler.loops.container_values import NOTES as VALUE_NOTES
from reconciler.loops.kubelet_notes import KUBELET_NOTES
from reconciler.mitigation.actions import WMARK_NOTES

LARGEST = str((1 << 63) - 1)
"""The longest value a memory file holds (v1's unlimited, in bytes)."""


def container_dir(n: int) -> str:
    """The longest cgroup path kubelet's systemd driver gives a container, on cgroup v1."""
    pod = str(uuid.UUID(int=n)).replace("-", "_")
    return (f"/sys/fs/cgroup/memory/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{pod}.slice/cri-containerd-{n:064x}.scope")


def test_notes_at_every_limit_read_back_whole(tmp_path: Path) -> None:
    path = tmp_path / STATE_FILE
    notes = StateFile(str(path), boot=str(uuid.uuid4()))
    # drift's notes and kubelet's values, of as many containers as they keep
    notes.replace(VALUE_NOTES, {f"{n:064x}": json.dumps([container_dir(n), {
        name: [LARGEST, LARGEST, LARGEST] for name in
        ("memory.soft_limit_in_bytes", "memory.limit_in_bytes", "memory.high", "oom")}])
        for n in range(MAX_KEPT)})
    notes.replace(KUBELET_NOTES, {f"{n:064x}": f"{LARGEST},-1000,max" for n in range(MAX_KEPT)})
    # then notes of files up to the most the file takes (one write: a note at a time would
    # write the whole file each time)
    room = statefile.MAX_ENTRIES - 2 * MAX_KEPT
    notes.replace(WMARK_NOTES, {f"{container_dir(n)}/memory.soft_limit_in_bytes": LARGEST
                                for n in range(room)})
    assert not notes.remember(WMARK_NOTES, "/one/more", LARGEST)
    assert path.stat().st_size <= statefile.MAX_FILE_BYTES
    again = StateFile(str(path))
    assert again.set_aside is None
    for section in (VALUE_NOTES, KUBELET_NOTES, WMARK_NOTES):
        assert again.entries(section) == notes.entries(section)
