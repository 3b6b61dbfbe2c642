"""A container's own memcg values drift sets, and what they go back to when their cause goes.

Drift writes a container's ``memory.min``/``memory.low``/``memory.high`` (cgroup v1:
``memory.limit_in_bytes``/``memory.soft_limit_in_bytes``) while a policy asks for them; an
annotation removed through the API, a level lowered and restored, a reload that sets a level's
memory policy to none or turns memory QoS off stop asking, and the value must go back. The rule is
the one of the cgroups above (:mod:`reconciler.loops.protection`): each file drift set is noted
with the value it held before drift's first write and the value last set; once the policy no
longer asks for it, the value from before is written back, but only while the file still holds
the agent's last value (one someone else wrote since is theirs: left, its note dropped).

A value the runtime applied at creation from the agent's own answer has no value from before:
drift finds the file already holding what it wants. It goes back to what kubelet sets without
the agent: on cgroup v2 ``memory.min`` = the request kubelet's MemoryQoS wrote (the runtime's
``memory.min`` at creation, else 0), ``memory.low`` = 0, and ``memory.high`` = the one kubelet's
MemoryQoS wrote (the runtime's at creation), else ``max`` (where kubelet wrote a request but
its ``memory.high`` is not known, it depends on kubelet's throttling factor, which the agent
does not know: the file is left as it is, and said); on
cgroup v1 the soft limit = kubelet's reservation, else unlimited, and the limit = the
container's own.

The processes' ``oom_score_adj`` follow the same rule, noted per container (:data:`OOM`): the
score drift last set; once no policy asks for one, every process of the container that still
holds it gets kubelet's score (the container's, as the runtime gave it at CreateContainer and
PostUpdateContainer), whether drift wrote the score or found it there. A process's value from
before is not used: a process started since inherits its parent's score, the agent's own
included. A process holding another score is someone else's: left. Where kubelet's score is not
known, the agent's is left, and said.

Observe mode writes nothing new, and gives back what drift wrote (:meth:`ContainerValues.give_back`,
never held back): each file and process that still holds drift's last value gets the value it
held before drift's first write, a value applied at creation that drift changed gets that value
again (the CreateContainer answers are given in observe mode too), and values drift found
applied at creation stay. A write back that observe mode holds (a value applied at creation that
the policy no longer asks for) keeps its note for when the agent enforces again; one the kernel
refuses keeps it too, and is tried again at the next cycle.

Notes are kept for running containers only, and across restarts in the state file (section
:data:`NOTES`): an agent restarted with a configuration that no longer asks for a value (the
DaemonSet rolls out at every change of its configuration) gives back what the earlier run set
or found applied at creation. A note of a value drift is about to write over is saved before the
write, so an agent killed right after it (SIGKILL, an OOM kill) leaves the note for the next run:
drift notes every such value of a cycle first (:meth:`ContainerValues.ahead`) and saves them in
one write before it writes any (one write a cycle, not one per value: each writes the whole
file, which made a first cycle of 3,000 containers take 69 s instead of 2.5,
``bench/reconcile.py``); a write outside that (``persist``) saves its own note first. A value
found applied at creation is saved at the end of the cycle, and one not yet saved when the agent
was killed counts as applied at creation after the restart too.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import structlog

from hooks.model import ContainerInfo
from reconciler.host.cgroups import CgroupLayout, subtree_ids
from reconciler.host.procfs import oom_score_adj_path, set_oom_score_adj
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.host.values import same_bytes, same_text

log = structlog.get_logger("nri_qos.reconciler")

OOM = "oom_score_adj"
"""The note of the container's processes' ``/proc/<pid>/oom_score_adj``."""
NOTES = "container_values"
"""The state file's section of the notes: container id -> the JSON array
``[cgroup, {file: [before, written, undo]}]``."""
MAX_KEPT = 4096
"""Containers whose notes the state file keeps at most (as many as kubelet's pods on the
largest nodes, each with several containers): the file stays a few MiB at most. Notes beyond
it live in memory only."""
_FILES = frozenset({"memory.min", "memory.low", "memory.high", "memory.limit_in_bytes",
                    "memory.soft_limit_in_bytes", OOM})
"""What a note may name: a note read back names a file drift writes, and nothing else."""
_OBSERVE = "observe mode: the node is watched, not acted on"


@dataclass(slots=True)
class _Note:
    before: str | None  # None: applied at creation, kubelet's value is what it goes back to
    written: str
    # What observe mode gives back: the value before drift's first write; None while drift has
    # written nothing over what it found applied at creation.
    undo: str | None = None

    def wrote_over(self, value: str) -> None:
        """Drift wrote ``value`` over the note's last value."""
        if self.undo is None:
            self.undo = self.written
        self.written = value


Kubelets = Callable[[], ContainerInfo | None]
"""The container as kubelet gave it to the runtime (its request and limit), if known."""


class ContainerValues:
    """The notes of the container files drift set, per container id."""

    def __init__(self, sysfs: SysFs, layout: CgroupLayout,
                 persist: Callable[[], None] | None = None) -> None:
        """``persist``: saves the notes, called once a note of a value about to be written
        over is taken (before the write)."""
        self._sysfs = sysfs
        self._layout = layout
        self._persist = persist
        # (container id, file) noted by :meth:`ahead` and saved, not yet written
        self._ahead: set[tuple[str, str]] = set()
        # container id -> the processes :meth:`ahead` found, for :meth:`set_score` to write
        # (the list is read once a cycle)
        self._pids: dict[str, list[int]] = {}
        # container id -> (its memory cgroup directory, file name -> note)
        self._notes: dict[str, tuple[str, dict[str, _Note]]] = {}
        self._version = 0  # counts the changes to the notes

    @property
    def version(self) -> int:
        """Changes with every change to the notes (what the state file keeps is written again
        only then)."""
        return self._version

    def __len__(self) -> int:
        return len(self._notes)

    def noted(self) -> dict[str, str]:
        """The notes as the state file keeps them (:data:`NOTES`), of :data:`MAX_KEPT`
        containers at most."""
        return {cid: json.dumps([cgroup, {name: [note.before, note.written, note.undo]
                                          for name, note in files.items()}])
                for cid, (cgroup, files) in itertools.islice(self._notes.items(), MAX_KEPT)}

    def take(self, entries: Mapping[str, str]) -> None:
        """The notes an earlier run kept (:meth:`noted`); a container's that do not read as
        notes are left out, and said."""
        for cid, text in entries.items():
            read = _read_notes(text)
            if read is None:
                log.warning("state_note_invalid", section=NOTES, key=cid, value=text)
                continue
            self._notes[cid] = read
            self._version += 1

    def ahead(self, cid: str, cgroup: str, values: Mapping[str, str],
              score: int | None) -> None:
        """Notes, without saving them, the values of the container's files and processes' score
        that :meth:`set` and :meth:`set_score` are about to write over (those with no note yet
        that hold another value): the caller saves the notes once, then writes."""
        if self._sysfs.held():
            return
        for name, value in values.items():
            if self._note(cid, name) is None:
                current = self._sysfs.read(f"{cgroup}/{name}")
                if current is not None and not same_bytes(current, value):
                    self._take(cid, cgroup, name, _Note(current.strip(), value, current.strip()),
                               ahead=True)
        if score is None or self._note(cid, OOM) is not None:
            return
        self._pids[cid] = pids = subtree_ids(self._sysfs, cgroup)
        for pid in pids:
            current = self._sysfs.read(oom_score_adj_path(pid))
            if current is not None and not same_text(current, str(score)):
                self._take(cid, cgroup, OOM, _Note(None, str(score), current.strip()), ahead=True)
                return

    def _take(self, cid: str, cgroup: str, name: str, note: _Note, *, ahead: bool) -> None:
        """Notes a file (or the processes' score) before drift's first write over it: for the
        caller of :meth:`ahead` to save with the others, or saved here before the write (a
        run killed right after the write leaves it)."""
        self._notes.setdefault(cid, (cgroup, {}))[1][name] = note
        self._version += 1
        if ahead:
            self._ahead.add((cid, name))
        elif self._persist is not None:
            self._persist()

    def _noted_ahead(self, cid: str, name: str) -> _Note | None:
        """The note :meth:`ahead` took of the file for this write (None: none)."""
        if (cid, name) not in self._ahead:
            return None
        self._ahead.discard((cid, name))
        return self._note(cid, name)

    def set(self, cid: str, cgroup: str, name: str, value: str, reason: str) -> None:
        """Writes ``value`` unless the file holds it, noting what it held before."""
        path = f"{cgroup}/{name}"
        if self._sysfs.held():  # observe mode: audited, and nothing of the agent's to note
            self._sysfs.write_if_changed(path, value, reason, same=same_bytes)
            return
        ahead = self._noted_ahead(cid, name)
        note = None if ahead is not None else self._note(cid, name)
        current = ahead.before if ahead is not None else \
            self._sysfs.read(path) if note is None else None
        if ahead is None and current is not None and not same_bytes(current, value):
            self._take(cid, cgroup, name, _Note(current.strip(), value, current.strip()),
                       ahead=False)
        outcome = self._sysfs.write_if_changed(path, value, reason, same=same_bytes)
        if note is not None:
            if outcome is Outcome.WRITTEN:
                note.wrote_over(value)
                self._version += 1
            elif outcome is Outcome.UNCHANGED and note.written != value:
                note.written = value
                self._version += 1
            return
        if outcome is Outcome.UNCHANGED:  # the runtime applied it at creation
            before = None
        elif outcome is Outcome.WRITTEN and current is not None:
            before = current.strip()
        else:
            self._drop(cid, name)  # gone or refused: nothing of the agent's is on the file
            return
        self._notes.setdefault(cid, (cgroup, {}))[1][name] = _Note(before, value, before)
        self._version += 1

    def set_score(self, cid: str, cgroup: str, score: int, reason: str) -> None:
        """Writes ``score`` to every process of the container that does not hold it."""
        # Those of the cgroups it made below its own too (cgroup v2 keeps none beside them).
        found_ahead = self._pids.pop(cid, None)
        pids = subtree_ids(self._sysfs, cgroup) if found_ahead is None else found_ahead
        if self._sysfs.held():
            for pid in pids:
                set_oom_score_adj(self._sysfs, pid, score, reason)
            return
        ahead = self._noted_ahead(cid, OOM) is not None
        value, note = str(score), None if ahead else self._note(cid, OOM)
        found: str | None = None  # a score drift wrote over, while nothing is noted
        applied = False  # some process holds the score now
        for pid in pids:
            current = self._sysfs.read(oom_score_adj_path(pid)) if note is None else None
            if current is not None and not same_text(current, value) \
                    and self._note(cid, OOM) is None:
                self._take(cid, cgroup, OOM, _Note(None, value, current.strip()), ahead=False)
            outcome = set_oom_score_adj(self._sysfs, pid, score, reason)
            applied |= outcome in (Outcome.WRITTEN, Outcome.UNCHANGED)
            if outcome is Outcome.WRITTEN and note is not None and note.written != value:
                note.wrote_over(value)
                self._version += 1
            elif outcome is Outcome.WRITTEN and found is None and current is not None:
                found = current.strip()
        if note is not None and applied and note.written != value:
            note.written = value
            self._version += 1
        elif note is None and applied:
            self._notes.setdefault(cid, (cgroup, {}))[1][OOM] = _Note(None, value, found)
            self._version += 1
        elif note is None:
            self._drop(cid, OOM)

    def _note(self, cid: str, name: str) -> _Note | None:
        entry = self._notes.get(cid)
        return None if entry is None else entry[1].get(name)

    def _drop(self, cid: str, name: str) -> None:
        """Takes back a note taken before a write that did not happen."""
        entry = self._notes.get(cid)
        if entry is None or name not in entry[1]:
            return
        del entry[1][name]
        if not entry[1]:
            del self._notes[cid]
        self._version += 1

    def release(self, cid: str, keep: Collection[str], kubelets: Kubelets,
                reason: str) -> None:
        """Writes back the noted files of the container that its policy no longer asks for
        (not in ``keep``)."""
        entry = self._notes.get(cid)
        if entry is None:
            return
        cgroup, files = entry
        for name in [name for name in files if name not in keep]:
            done = (self._score_back(cgroup, files[name], kubelets, reason) if name == OOM
                    else self._write_back(f"{cgroup}/{name}", name, files[name], kubelets,
                                          reason))
            if done:
                del files[name]
                self._version += 1
        if not files:
            del self._notes[cid]
            self._version += 1

    def release_all(self, kubelets: Callable[[str], Kubelets], reason: str, *,
                    skip: Collection[str] = ()) -> None:
        """Writes back the noted files of every container but those in ``skip``."""
        for cid in [cid for cid in self._notes if cid not in skip]:
            # One container's odd cgroup must not keep the others' values from going back.
            try:
                self.release(cid, (), kubelets(cid), reason)
            except (OSError, ValueError) as exc:
                log.warning("drift_container_failed", container=cid, error=str(exc))

    def give_back(self) -> None:
        """Observe mode: writes back what drift wrote, where it still holds drift's last value,
        never held back (undoing returns the node to what it was)."""
        sysfs = self._sysfs.unobserved()
        for cid in list(self._notes):
            cgroup, files = self._notes[cid]
            for name, note in list(files.items()):
                if note.undo is None:
                    continue  # applied at creation: observe mode gives that too
                if name == OOM:
                    outcomes = [set_oom_score_adj(sysfs, pid, int(note.undo), _OBSERVE)
                                for pid in self._holding(cgroup, note, note.undo, _OBSERVE)]
                else:
                    path = f"{cgroup}/{name}"
                    if not self._holds(path, note, _OBSERVE):
                        del files[name]
                        self._version += 1
                        continue
                    outcomes = [sysfs.write_if_changed(path, note.undo, _OBSERVE,
                                                       same=same_bytes)]
                if Outcome.FAILED in outcomes:
                    continue  # refused: the note stays, to be given back at the next cycle
                if note.before is None:  # back at what the runtime applied at creation
                    files[name] = _Note(None, note.undo)
                    self._version += 1
                else:
                    del files[name]
                    self._version += 1
            if not files:
                del self._notes[cid]
                self._version += 1

    def forget_others(self, running: Collection[str]) -> None:
        """Drops the notes of containers that no longer run: their cgroups went with them, or
        the runtime sets them anew when they start again."""
        for cid in [cid for cid in self._notes if cid not in running]:
            del self._notes[cid]
            self._version += 1
        self._ahead = {key for key in self._ahead if key[0] in self._notes}
        self._pids = {cid: pids for cid, pids in self._pids.items() if cid in running}

    def _holds(self, path: str, note: _Note, reason: str) -> bool:
        """Whether the file still holds drift's last value (one someone else wrote is said)."""
        current = self._sysfs.read(path)
        if current is None:
            return False
        if not same_bytes(current, note.written):
            log.warning("container_value_changed_by_someone_else", path=path,
                        written=note.written, current=current.strip(), reason=reason)
            return False
        return True

    def _holding(self, cgroup: str, note: _Note, back: str | None, reason: str) -> list[int]:
        """The container's processes that still hold drift's last score; the others are
        someone else's (said), but for those at ``back``, the score they go back to."""
        holding = []
        for pid in subtree_ids(self._sysfs, cgroup):
            current = self._sysfs.read(oom_score_adj_path(pid))
            if current is None or current.strip() == back:
                continue
            if current.strip() == note.written:
                holding.append(pid)
            else:
                log.warning("container_value_changed_by_someone_else", path=oom_score_adj_path(pid),
                            written=note.written, current=current.strip(), reason=reason)
        return holding

    def _score_back(self, cgroup: str, note: _Note, kubelets: Kubelets, reason: str) -> bool:
        """Gives kubelet's score to the processes holding drift's last one; whether the note is
        done with (not when observe mode held a write, or one failed)."""
        container = kubelets()
        target = None if container is None else container.oom_score_adj
        pids = self._holding(cgroup, note, None if target is None else str(target), reason)
        if target is None:
            for pid in pids:
                log.warning("container_value_left", path=oom_score_adj_path(pid),
                            value=note.written, reason=reason,
                            why="kubelet's oom_score_adj is not known")
            return True
        outcomes = [set_oom_score_adj(self._sysfs, pid, target, f"{reason}: no longer asked for")
                    for pid in pids]
        return not any(o in (Outcome.OBSERVED, Outcome.FAILED) for o in outcomes)

    def _write_back(self, path: str, name: str, note: _Note, kubelets: Kubelets,
                    reason: str) -> bool:
        """Whether the note is done with (written back, gone, someone else's)."""
        if not self._holds(path, note, reason):
            return True
        target = note.before if note.before is not None else \
            _kubelets_value(self._layout, name, kubelets())
        if target is None:
            log.warning("container_value_left", path=path, value=note.written, reason=reason,
                        why="kubelet's MemoryQoS sets memory.high from a throttling factor "
                            "the agent does not know")
            return True
        outcome = self._sysfs.write_if_changed(path, target, f"{reason}: no longer asked for",
                                               same=same_bytes)
        return outcome in (Outcome.WRITTEN, Outcome.UNCHANGED, Outcome.GONE)


def _kubelets_value(layout: CgroupLayout, name: str, container: ContainerInfo | None
                    ) -> str | None:
    """What kubelet sets on the file without the agent; None when the agent cannot know."""
    request = None if container is None else container.memory_request
    unlimited = layout.unlimited
    if not layout.v2:
        if name == "memory.soft_limit_in_bytes":
            return unlimited if request is None else str(request)
        limit = None if container is None else container.memory_limit
        return unlimited if limit is None else str(limit)
    if name == "memory.min":
        return "0" if request is None else str(request)
    if name == "memory.high":
        high = None if container is None else container.memory_high
        if high is not None:
            return high
        return unlimited if request is None else None
    return "0"


def _read_notes(text: str) -> tuple[str, dict[str, _Note]] | None:
    """A container's notes as :meth:`ContainerValues.noted` wrote them; None when they are not
    (a file drift does not write included)."""
    try:
        fields = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(fields, list) and len(fields) == 2):
        return None
    cgroup, files = fields
    if not (isinstance(cgroup, str) and cgroup and isinstance(files, dict) and files):
        return None
    notes = {}
    for name, values in files.items():
        if name not in _FILES or not (isinstance(values, list) and len(values) == 3):
            return None
        before, written, undo = values
        if not (isinstance(written, str)
                and all(v is None or isinstance(v, str) for v in (before, undo))):
            return None
        notes[name] = _Note(before, written, undo)
    return cgroup, notes
