"""Kubelet's values of each container, kept across restarts of the agent.

What a container goes back to when no policy asks for a value any more is kubelet's: its
``oom_score_adj`` and its request (:mod:`reconciler.loops.container_values`). The runtime shows
them only at CreateContainer and PostUpdateContainer; Synchronize lists each container's spec with
this agent's adjustment in it. An agent restarted (an upgrade, a crash) would take its own
creation answer for kubelet's, and give back nothing. So drift notes kubelet's values of the
containers the node state knows in the state file (section :data:`KUBELET_NOTES`, one note per
container, replaced whole when they change), and the next run's node state takes them for the
containers of its first Synchronize.

Only after a Synchronize (before it the node state is empty, and would wipe the earlier run's
notes). A container created in the last drift interval before a crash has no note: its
Synchronize values stand, as without notes.

Where no drift runs after them (``nri-qos reset``, a start with the reconciler off), what drift
noted is given back from these notes (:func:`give_back_noted`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import structlog

from common.state import KubeletValues, NodeState
from hooks.model import ContainerInfo
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.loops.container_values import MAX_KEPT, NOTES, ContainerValues

log = structlog.get_logger("nri_qos.reconciler")

KUBELET_NOTES = "kubelet"
"""The state file's section: container id -> ``"<request>,<score>,<memory.high>"`` (empty
where none), of :data:`~reconciler.loops.container_values.MAX_KEPT` containers at most."""


def encode(values: KubeletValues) -> str:
    return ",".join("" if value is None else str(value) for value in values)


def decode(text: str) -> KubeletValues | None:
    """The values of a note; None for a note that is not two integers and a ``memory.high``
    (``max`` or digits), each of them possibly empty."""
    parts = text.split(",")
    if len(parts) != 3:
        return None
    try:
        request, score = (int(part) if part else None for part in parts[:2])
    except ValueError:
        return None
    high = parts[2] or None
    if high is not None and high != "max" and not (high.isascii() and high.isdigit()):
        return None
    return request, score, high


def noted(notes: StateFile) -> dict[str, KubeletValues]:
    """Kubelet's values an earlier run noted, by container id (unreadable notes left out)."""
    values = {}
    for cid, text in notes.entries(KUBELET_NOTES).items():
        decoded = decode(text)
        if decoded is None:
            log.warning("state_note_invalid", section=KUBELET_NOTES, key=cid, value=text)
            continue
        values[cid] = decoded
    return values


class KubeletNotes:
    """Keeps the state file's section in step with the node state."""

    def __init__(self, state: NodeState, notes: StateFile) -> None:
        self._state = state
        self._notes = notes
        self._version: int | None = None  # the node state's, at the last save

    def save(self) -> None:
        """Notes the node state's containers when the node state changed since the last save
        (the state file is written only when the notes differ)."""
        if not self._state.synced or self._state.version == self._version:
            return
        self._version = self._state.version
        self._notes.replace(KUBELET_NOTES, {
            cid: encode(v) for cid, v in
            itertools.islice(self._state.kubelets().items(), MAX_KEPT)})


def give_back_noted(sysfs: SysFs, layout: CgroupLayout, notes: StateFile,
                    reason: str) -> tuple[int, list[str]]:
    """Gives back every container value the state file says drift set or found applied at
    creation, as drift does once no policy asks for it (never held back by observe mode:
    undoing returns the node to what it was); (containers given back, ids of those whose notes
    are left: a write refused). Kubelet's values are forgotten once nothing is left."""
    values = ContainerValues(sysfs.unobserved(), layout)
    values.take(notes.entries(NOTES))
    kubelets = noted(notes)

    def kubelets_of(cid: str) -> Callable[[], ContainerInfo | None]:
        known = kubelets.get(cid)
        info = None if known is None else ContainerInfo(
            id=cid, pod_sandbox_id="", name="", memory_request=known[0], oom_score_adj=known[1],
            memory_high=known[2])
        return lambda: info

    before = len(values)
    values.release_all(kubelets_of, reason)
    left = values.noted()
    notes.replace(NOTES, left)
    if not left:
        notes.replace(KUBELET_NOTES, {})
    return before - len(left), sorted(left)
