"""Memory protection that reaches the kernel: the pod and tier cgroups above a protected container.

On cgroup v2 a container's ``memory.min`` and ``memory.low`` protect it only as far as its
ancestors' do: the kernel bounds a cgroup's effective protection by its parent's, from the
reclaiming cgroup's children down (Documentation/admin-guide/cgroup-v2.rst, "Effective min
boundary is limited by memory.min values of all ancestor cgroups"). kubelet without its
MemoryQoS feature leaves the pod cgroups, the QoS-tier cgroups and ``kubepods`` at 0, so the
protection the CreateContainer answer gives an online container is worth nothing when
``kubepods`` reaches node-allocatable or the machine reclaims: seen in a two-node v2 guest, the
online container's file pages were reclaimed and read again (hundreds of refaults a window)
beside an offline job, with ``memory.min`` above all it held.

So each ancestor in kubelet's layout (the pod's cgroup, its QoS tier, ``kubepods``) gets the sum
of what the policies give the running containers below it (:func:`ancestor_sums`). A file is
only raised: where it already holds at least the sum (kubelet's MemoryQoS sets the pod and tier
to the requests), it is left alone. The value from before the first write is noted in the state
file, and beside it the value the agent last wrote; when the sum falls (a pod went) the file goes
down to the sum, never below what it held before; a file that no longer holds the agent's last
write was changed by someone else (kubelet, an operator) and is theirs again: left as it is, its
notes dropped, logged. The noted files are written back when memory QoS or the reconciler is
switched off, at a start with the reconciler off, and by ``nri-qos reset``, all of which compare
with the noted last write, so a later run or the reset tells someone else's value from the
agent's own. They stay while the agent stops: the containers keep their own protection, and the
next run takes the notes up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import structlog

from reconciler.host.cgroups import GUARANTEED, CgroupLayout, CgroupRef, pod_rel, tier_rel
from reconciler.host.statefile import StateFile, restore_noted
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.host.values import PAGE_SIZE, parse_bytes

log = structlog.get_logger("nri_qos.reconciler")

PROTECTION_NOTES = "protection"
"""State-file section: each ancestor file the agent raised, with its value from before."""
WRITTEN_NOTES = "protection_written"
"""State-file section: the value the agent last wrote to each file of :data:`PROTECTION_NOTES`.
A file noted without one (noted by an agent that kept no such section, its write cut short by a
crash, or no room left in the state file) is written back whatever it holds. A section of its
own, so that an agent that knows only :data:`PROTECTION_NOTES` reads its notes as they are."""
KEYS = ("memory.min", "memory.low")


def ancestors(ref: CgroupRef) -> list[str]:
    """The cgroups above a container that bound its protection, nearest first (relative to the
    hierarchy root): its pod, its QoS tier unless Guaranteed (whose pods sit in ``kubepods``)
    and ``kubepods``; none for a cgroup outside kubelet's layout."""
    if ref.tier is None:
        return []
    chain = [pod_rel(ref)]
    if ref.tier != GUARANTEED:
        chain.append(tier_rel(ref.driver, ref.tier))
    chain.append(tier_rel(ref.driver, GUARANTEED))
    return chain


def ancestor_sums(containers: Iterable[tuple[CgroupRef, Mapping[str, int]]]
                  ) -> dict[str, dict[str, int]]:
    """Each ancestor's sum of its containers' protection, by file name (``memory.min``,
    ``memory.low``); an ancestor whose sums are all 0 is left out."""
    sums: dict[str, dict[str, int]] = {}
    for ref, values in containers:
        for rel in ancestors(ref):
            into = sums.setdefault(rel, {})
            for key in KEYS:
                into[key] = into.get(key, 0) + values.get(key, 0)
    return {rel: values for rel, values in sums.items() if any(values.values())}


class AncestorProtection:
    """Writes the sums onto the ancestors' files (cgroup v2) and undoes what it wrote."""

    def __init__(self, sysfs: SysFs, layout: CgroupLayout, notes: StateFile) -> None:
        self._sysfs = sysfs
        self._layout = layout
        self._notes = notes

    def apply(self, sums: Mapping[str, Mapping[str, int]], reason: str) -> None:
        wanted = {f"{self._layout.dir('memory', rel)}/{key}": value
                  for rel, values in sums.items() for key, value in values.items()}
        if self._sysfs.held():
            # Observe mode: what an enforcing run raised goes back; the raises are decided and
            # audited (as observed writes) only.
            if self._notes.entries(PROTECTION_NOTES):
                self.restore("observe mode: the node is watched, not acted on")
            for path, total in wanted.items():
                current = _bytes(self._sysfs.read(path))
                if current is not None and current < _pages(total):
                    self._sysfs.write_if_changed(path, str(_pages(total)),
                                                 f"{reason}: the sum below it")
            return
        notes = self._notes.entries(PROTECTION_NOTES)
        written = self._notes.entries(WRITTEN_NOTES)
        for path in sorted(set(notes) | set(wanted)):
            try:
                self._settle(path, wanted.get(path, 0), notes.get(path), written.get(path),
                             reason)
            except ValueError as exc:  # the file, or a note, holds no size: left as it is
                log.warning("protection_unreadable", path=path, error=str(exc))

    def _settle(self, path: str, total: int, noted: str | None, written: str | None,
                reason: str) -> None:
        """``noted``, ``written``: the file's value from before and the agent's last write,
        as the state file holds them."""
        current = _bytes(self._sysfs.read(path))
        if current is None:  # the pod's cgroup is gone, and its file with it
            _forget(self._notes, path)
            return
        if noted is not None and written is not None and current != _bytes(written):
            _theirs(self._notes, path, written, current, reason)
            return
        before = current if noted is None else _bytes(noted) or 0
        target = max(_pages(total), before)
        if target == current or (noted is None and current >= target):
            if noted is not None and target == before:
                _forget(self._notes, path)  # back at what it held before
            return
        if noted is None and not self._notes.remember(PROTECTION_NOTES, path, str(current)):
            return  # the state file is full: no change that could not be undone
        # No last write noted while this one is under way: a crash in between leaves a note
        # that restores whatever the file holds, not one that takes this write for someone
        # else's and leaves it on the node for good.
        self._notes.forget(WRITTEN_NOTES, path)
        outcome = self._sysfs.write_if_changed(path, str(target), f"{reason}: the sum below it")
        if outcome is Outcome.OBSERVED or target == before:
            _forget(self._notes, path)  # observe mode changed nothing; or back at before
        elif outcome in (Outcome.WRITTEN, Outcome.UNCHANGED):
            self._notes.remember(WRITTEN_NOTES, path, str(target))
        elif noted is not None and written is not None:  # not written: it holds the last still
            self._notes.remember(WRITTEN_NOTES, path, written)

    def restore(self, reason: str) -> int:
        """As :func:`restore_protection`."""
        return restore_protection(self._sysfs, self._notes, reason)


def restore_protection(sysfs: SysFs, notes: StateFile, reason: str) -> int:
    """Writes back every ancestor file noted in the state file but those that no longer hold
    the agent's last write (someone else's since: left, their notes dropped); how many were
    written."""
    written = notes.entries(WRITTEN_NOTES)
    for path in sorted(notes.entries(PROTECTION_NOTES).keys() & written.keys()):
        try:
            current = _bytes(sysfs.read(path))
            ours = _bytes(written[path])
        except ValueError:
            continue  # the file, or the note, holds no size: written back like any other
        if current is not None and current != ours:
            _theirs(notes, path, written[path], current, reason)
    restored = restore_noted(sysfs, notes, PROTECTION_NOTES, reason)
    for path in written.keys() - notes.entries(PROTECTION_NOTES).keys():
        notes.forget(WRITTEN_NOTES, path)  # written back, gone, or someone else's
    return restored


def _forget(notes: StateFile, path: str) -> None:
    """Drops a file's notes, its last write first: cut short in between, what is left is a
    note that restores the file whatever it holds."""
    notes.forget(WRITTEN_NOTES, path)
    notes.forget(PROTECTION_NOTES, path)


def _theirs(notes: StateFile, path: str, written: str, current: int, reason: str) -> None:
    """A file someone else changed since the agent's last write: theirs again, left as it is."""
    log.warning("protection_changed_by_someone_else", path=path, written=written,
                current=current, reason=reason)
    _forget(notes, path)


def _pages(value: int) -> int:
    """Rounded down to whole pages, as the kernel keeps it."""
    return value // PAGE_SIZE * PAGE_SIZE


def _bytes(text: str | None) -> int | None:
    """A protection file's value in bytes; ``max`` reads as no upper bound."""
    if text is None:
        return None
    value = parse_bytes(text.strip())
    return (1 << 63) - 1 if value is None else value
