"""Drift repair: keep running containers' memcg and oom_score_adj at what the policies want.

The desired settings come from the same pure policies as the CreateContainer answer
(:func:`hooks.memory_qos.memory_settings`, :func:`hooks.oom_score.oom_score`), fed with the merged
node state, so a pod that predates the plugin, an annotation changed through the API server, a
runtime that ignored an adjustment field and a value someone overwrote all converge to the one
answer. Nothing is written where the kernel already holds that value, so containers whose runtime
applied the adjustment cost only reads.

Files: cgroup v2 ``memory.min``/``memory.low``/``memory.high`` (the ``memory.*`` keys of the unified
settings); cgroup v1 ``memory.limit_in_bytes`` and ``memory.soft_limit_in_bytes``; and
``/proc/<pid>/oom_score_adj`` of every process in the container's ``cgroup.procs`` and the
cgroups below it (:func:`~reconciler.host.cgroups.subtree_ids`). On cgroup v2
the pod, tier and ``kubepods`` cgroups above get the sum of the containers' ``memory.min`` and
``memory.low``, without which the kernel does not honour them
(:mod:`reconciler.loops.protection`). A container's file the policies stop asking for goes back
to its value from before, or to kubelet's, and its processes' score to kubelet's; in observe mode
what drift wrote goes back (:mod:`reconciler.loops.container_values`).

A memory QoS or oom_score_adj annotation the API server changed after the container was
created is read here and nowhere else, so a problem with it is recorded here
(``annotation_ignored``, once per container and value, the level's values applied); problems
of the annotations the runtime gave at creation were recorded by the CreateContainer answer.

The same loop is how oom_score_adj reaches containers on runtimes that do not apply it from the
CreateContainer answer (containerd before 1.7.26): the answer leaves it out
(``adjustment_deferred``), the loop wakes at StartContainer and writes it, with a reason that
says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import structlog

from common.audit import AuditLog
from common.state import NodeState
from hooks.events import Event
from hooks.memory_qos import VOLCANO_ANNOTATION, MemoryConfig, memory_settings
from hooks.oom_score import OomConfig, oom_score
from hooks.settings import ContainerSettings, merge
from hooks.untrusted import bounded
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.host.values import parse_bytes
from reconciler.loops.base import Loop, ReconcilerConfig
from reconciler.loops.common import Managed, ManagedCache
from reconciler.loops.container_values import NOTES, OOM, ContainerValues, Kubelets
from reconciler.loops.kubelet_notes import KubeletNotes
from reconciler.loops.protection import KEYS, AncestorProtection, ancestor_sums

log = structlog.get_logger("nri_qos.reconciler")

MAX_REASON_CHARS = 1024
"""The longest reason of one record: the problems of one annotation, each bounded by its policy."""

_V1_FILES = (("memory_limit", "memory.limit_in_bytes"),
             ("memory_reservation", "memory.soft_limit_in_bytes"))


class DriftSections(Protocol):
    """The sections the drift loop reads."""

    @property
    def reconciler(self) -> ReconcilerConfig: ...

    @property
    def memory(self) -> MemoryConfig: ...

    @property
    def oom(self) -> OomConfig: ...


class DriftLoop(Loop):
    """``memory_total`` is the host's memory (bytes), as the memory QoS capability reads it at
    creation (the host probe), so both compute the same memory.high for a container without a
    limit."""

    name = "drift"
    # PostUpdateContainer: a resize's new limit is known from there, not at UpdateContainer.
    wake_events = frozenset({Event.START_CONTAINER, Event.UPDATE_CONTAINER,
                             Event.POST_UPDATE_CONTAINER})
    wake_on_meta = True

    def __init__(self, config: Callable[[], DriftSections], state: NodeState, sysfs: SysFs,
                 layout: CgroupLayout, memory_total: int, *,
                 audit: AuditLog | None = None, managed: ManagedCache | None = None,
                 notes: StateFile | None = None) -> None:
        self._audit = audit
        self._protection = AncestorProtection(sysfs, layout,
                                              notes if notes is not None else StateFile(None))
        # (pod uid, container, problems) of the annotations recorded and still unusable
        self._reported: set[tuple[str, str, str]] = set()
        self._config = config
        self._state = state
        self._sysfs = sysfs
        self._layout = layout
        self._memory_total = memory_total
        self._values = ContainerValues(sysfs, layout, persist=self._save_notes)
        # What an earlier run set, given back the same (a simulation keeps no notes).
        self._notes = notes
        if notes is not None:
            self._values.take(notes.entries(NOTES))
        self._saved = self._values.version  # of the notes the state file holds
        self._managed = ManagedCache() if managed is None else managed
        self._desired_key: tuple[tuple[Managed, ...], DriftSections] | None = None
        self._desired: list[tuple[Managed, ContainerSettings]] = []
        # Kubelet's values, for what the next run gives back; a simulation keeps no notes.
        self._kubelet_notes = None if notes is None else KubeletNotes(state, notes)

    def interval(self) -> float:
        return self._config().reconciler.drift_interval_s

    def cycle(self, now: float) -> None:
        try:
            self._cycle()
        finally:
            self._save_notes()

    def _save_notes(self) -> None:
        """The notes of the values drift set and kubelet's values, into the state file (where
        they changed): at the end of each cycle, and before drift's first write over a value."""
        if self._notes is not None and self._values.version != self._saved:
            self._notes.replace(NOTES, self._values.noted())
            self._saved = self._values.version
        if self._kubelet_notes is not None:
            self._kubelet_notes.save()

    def _cycle(self) -> None:
        if not self._state.synced:
            # Before the runtime's first list every container looks gone: the sums above them
            # would drop to nothing and come back once it arrives, and the notes would go.
            return
        cfg = self._config()
        if len(self._values):
            self._values.forget_others(
                {item.view.info.id for item in self._managed.get(self._state.snapshot())})
            if self._sysfs.held():
                # Observe: what an enforcing run wrote goes back, as the cgroups' above does.
                self._values.give_back()
        if not (cfg.reconciler.enabled and cfg.memory.enabled):
            self._protection.restore("memory QoS switched off")
        if not cfg.reconciler.enabled or not (cfg.memory.enabled or cfg.oom.enabled):
            self._values.release_all(self._kubelets, "drift: switched off")
            return
        managed = self._managed.get(self._state.snapshot())
        desired = self._desired_for(managed, cfg)
        if cfg.memory.enabled and self._layout.v2:
            # First: each of its notes is saved before its write, a write of the whole file,
            # cheaper while the containers' notes below are not in it yet (a first cycle).
            self._protection.apply(
                ancestor_sums((item.ref, _protection(settings)) for item, settings in desired),
                "drift: memory protection of the containers below")
        # What the cycle writes over is noted first and saved in one write, before any write:
        # an agent killed in the middle of the cycle leaves the notes of what it wrote.
        for item, settings in desired:
            with contextlib.suppress(OSError, ValueError):  # said by the write's attempt below
                self._values.ahead(*self._wanted(item, settings))
        self._save_notes()
        for item, settings in desired:
            # One container's odd cgroup must not keep the others from being repaired.
            try:
                self._apply(item, settings)
            except (OSError, ValueError) as exc:
                log.warning("drift_container_failed", container=item.view.info.name,
                            pod_uid=item.view.pod.info.uid, error=str(exc))
        if len(self._values):
            # A container whose policy now asks for nothing at all is no longer in ``desired``.
            asked = {item.view.info.id for item, _ in desired}
            self._values.release_all(self._kubelets, "drift: no longer asked for by the policy",
                                     skip=asked)

    def noted_containers(self) -> int:
        """How many containers have files drift set and would write back."""
        return len(self._values)

    def _kubelets(self, cid: str) -> Kubelets:
        return lambda: self._state.container(cid)

    def _desired_for(self, managed: tuple[Managed, ...],
                     cfg: DriftSections) -> list[tuple[Managed, ContainerSettings]]:
        if self._desired_key is not None and self._desired_key[0] is managed \
                and self._desired_key[1] is cfg:
            return self._desired
        allocatable = cfg.memory.node_allocatable_bytes or self._memory_total
        desired = []
        problems: list[tuple[Managed, str, str]] = []
        for item in managed:
            pod, container = item.view.pod.info, item.view.info
            changed = item.view.pod.changed_by_api
            parts: list[tuple[str, ContainerSettings]] = []
            if cfg.memory.enabled:
                memory = memory_settings(pod, container, item.level, cfg.memory,
                                         cgroup_v2=self._layout.v2, node_allocatable=allocatable)
                parts.append(("memory", memory.settings))
                if VOLCANO_ANNOTATION in changed and memory.problems:
                    problems.append((item, VOLCANO_ANNOTATION, "; ".join(memory.problems)))
            if cfg.oom.enabled:
                oom = oom_score(pod, container, item.level, cfg.oom)
                parts.append(("oom", oom.settings))
                if cfg.oom.annotation in changed and oom.problems:
                    problems.append((item, cfg.oom.annotation, "; ".join(oom.problems)))
            settings = merge(parts).settings
            if not settings.is_empty():
                desired.append((item, settings))
        self._report(problems)
        self._desired_key, self._desired = (managed, cfg), desired
        return desired

    def _report(self, problems: list[tuple[Managed, str, str]]) -> None:
        """One record per container and annotation (its problems together) while they last:
        the desired settings, and their problems, are worked out again at every change of the
        node state, and only a change of the problems is news."""
        present = set()
        for item, annotation, problem in problems:
            pod, name = item.view.pod.info, item.view.info.name
            key = (pod.uid, name, problem)
            present.add(key)
            if key in self._reported or self._audit is None:
                continue
            self._audit.record("annotation_ignored", pod_uid=bounded(pod.uid),
                               container=bounded(name), annotation=bounded(annotation),
                               reason=bounded(f"{problem}; the {item.level} policy's values "
                                              "apply", MAX_REASON_CHARS))
        self._reported = present

    def _wanted(self, item: Managed, settings: ContainerSettings
                ) -> tuple[str, str, dict[str, str], int | None]:
        """The container's id, memory cgroup, the files its settings ask for and its score."""
        if self._layout.v2:
            wanted = {key: value for key, value in settings.unified.items()
                      if key.startswith("memory.")}
        else:
            wanted = {filename: str(getattr(settings, attr)) for attr, filename in _V1_FILES
                      if getattr(settings, attr) is not None}
        return (item.view.info.id, self._layout.dir("memory", item.ref.rel), wanted,
                settings.oom_score_adj)

    def _apply(self, item: Managed, settings: ContainerSettings) -> None:
        cid, cgroup, wanted, _ = self._wanted(item, settings)
        reason = f"drift: {item.level} policy for {item.view.pod.info.namespace}/" \
                 f"{item.view.pod.info.name} {item.view.info.name}"
        for name, value in wanted.items():
            self._values.set(cid, cgroup, name, value, reason)
        keep = set(wanted)
        if settings.oom_score_adj is not None:
            keep.add(OOM)
            applied = self._state.runtime_fields
            score_reason = reason
            if applied is not None and "oom_score_adj" not in applied:
                # Not a repair: the runtime never applies it at creation, this is how it gets in.
                score_reason = f"{reason}: applied after start, the runtime does not apply " \
                               "oom_score_adj at creation"
            self._values.set_score(cid, cgroup, settings.oom_score_adj, score_reason)
        self._values.release(cid, keep, self._kubelets(cid), reason)


def _protection(settings: ContainerSettings) -> dict[str, int]:
    """A container's ``memory.min`` and ``memory.low`` in bytes, as its settings give them."""
    values = {}
    for key in KEYS:
        value = parse_bytes(settings.unified[key]) if key in settings.unified else None
        if value is not None:
            values[key] = value
    return values
