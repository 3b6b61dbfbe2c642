"""The resctrl capability: pod groups at RunPodSandbox, the CLOS at CreateContainer, cleanup at
RemovePodSandbox, and the groups following a reload.

Which group a container joins is :func:`hooks.resctrl_groups.place_container`, the same decision
the task-id loop applies to running containers.

A pod's group belongs to the pod (its uid), not to one sandbox: kubelet replaces a pod's sandbox
by running the new one before removing the old one, so the group goes with the last sandbox of
its pod that the node state knows.

A reload switching resctrl off removes every group of ours (their tasks go back to the root
group); any other reload sets each pod group of a known pod again from its annotation under the
new configuration, and in observe mode gives every pod group the kernel's default (no limit). A
pod group that the new configuration no longer gives its pod is not removed at the reload: the
task-id loop moves its tasks out and collects it after its grace. The class groups are the
daemon's to keep (:func:`hooks.resctrl_groups.plan_class_groups`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import structlog

from common.audit import AuditLog
from common.state import NodeState
from hooks.events import Event
from hooks.levels import LEVEL_NAMES
from hooks.model import ContainerInfo, PodInfo
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION, plan_pod_group
from hooks.resctrl_config import ResctrlConfig
from hooks.resctrl_groups import (
    class_group_name,
    parse_group_name,
    place_container,
    place_in_class_group,
    pod_group_name,
)
from hooks.settings import EMPTY_SETTINGS, ContainerSettings, HookStage, OciHookSpec
from hooks.untrusted import bounded
from nri_plugin.capabilities.reporting import Reporting
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability, ContainerEvent, PodEvent
from reconciler.host.resctrlfs import GroupError, ResctrlFs, removal_problem

HOOK_PROGRAM = "nri-qos-hook"
SWITCHED_OFF = "resctrl.enabled is false"
MAX_PLANS_KEPT = 4096
"""Pods whose planned group is kept: more than a node runs (kubelet's maxPods is 110 by
default); past it the record starts afresh rather than grow with pods it missed the removal
of."""

log = structlog.get_logger("nri_qos.nri")


class ResctrlCapability(Reporting, Capability):
    name = capability = "resctrl"
    events = frozenset({Event.RUN_POD_SANDBOX, Event.CREATE_CONTAINER, Event.REMOVE_POD_SANDBOX})
    # CreateContainer only looks groups up (stat); creating and removing them stays threaded.
    inline_events = frozenset({Event.CREATE_CONTAINER})

    def __init__(self, cfg: ResctrlConfig, fs: ResctrlFs, audit: AuditLog, *,
                 state: NodeState, strict: bool) -> None:
        super().__init__(audit, strict)
        self._cfg = cfg
        self._fs = fs
        self._state = state
        # Making a pod group, removing one and a reload's pass over them never interleave: a
        # group is not removed between a new sandbox of its pod becoming known and that
        # sandbox making it, nor made after a reload switched resctrl off.
        self._lock = threading.Lock()
        # pod uid -> (what the plan was made from, the planned group)
        self._plans: dict[str, tuple[tuple[ResctrlConfig, str, str | None, str | None],
                                     str | None]] = {}

    def reconfigure(self, config: Config) -> None:
        self._set_strict(config)
        with self._lock:
            self._cfg = config.resctrl
            if self._cfg.enabled:
                self._keep_pod_groups()
                return
            for group, problem in self._fs.remove_our_groups(reason=SWITCHED_OFF).items():
                log.warning("resctrl_group_not_removed", group=group, error=problem)

    def _keep_pod_groups(self) -> None:
        """Each pod group of a known pod as the configuration in force wants it: in observe
        mode no limit, and otherwise its pod's annotation under the new caps and level shares.
        A group that its pod's plan under the new configuration no longer gives it (pod groups
        off, another annotation key, a request neither its level's share nor the caps admit any
        longer) is left alone: new containers no longer join it (:func:`place_container`
        follows the plan), the task-id loop moves its tasks to their class group and collects it
        after ``gc_grace_s``. Removing it here could race a CreateContainer that has just named
        it, and the container would fail to start. A group whose pod is unknown is the loop's
        too; the problems of an annotation were audited when its sandbox ran."""
        views = {view.info.uid: view for view in self._state.snapshot().pods.values()}
        observing = self._fs.sysfs.held()
        for group in self._fs.our_groups():
            ref = parse_group_name(self._fs.prefix, group, LEVEL_NAMES)
            if ref is None or ref.kind != "pod":
                continue
            view = views.get(ref.key)
            plan = None if view is None else plan_pod_group(view.info, view.level, self._cfg,
                                                            self._fs.info)
            if plan is not None and plan.group != group:
                continue
            try:
                if observing:
                    self._fs.lift_limits(group)
                elif plan is not None and plan.schemata is not None:
                    self._fs.ensure_group(group, plan.schemata, reason=f"pod {ref.key}: config")
            except (GroupError, OSError) as exc:
                log.warning("resctrl_pod_group_not_updated", group=group, error=str(exc))

    def _class_names(self) -> list[str]:
        return [class_group_name(self._cfg.group_prefix, level)
                for level, lvl in self._cfg.levels.items() if lvl.enabled]

    def run_pod_sandbox(self, event: PodEvent) -> None:
        with self._lock:
            if not self._cfg.enabled:
                return
            plan = plan_pod_group(event.pod, event.level, self._cfg, self._fs.info)
            self._report(event.pod, "", plan.problems)
            if plan.group is None or plan.schemata is None:
                return
            fallback = place_in_class_group(event.level, self._cfg, self._fs.has_group).group
            self._fs.create_pod_group(plan.group, plan.schemata, pod_uid=event.pod.uid,
                                      class_groups=self._class_names(), fallback=fallback)

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        cfg = self._cfg
        if not cfg.enabled:
            return EMPTY_SETTINGS
        placement = place_container(self._planned(event, cfg), event.level, cfg,
                                    self._fs.has_group)
        group = placement.group
        if group is None:
            if placement.class_group_missing:
                self._audit.record(
                    "adjustment_skipped", pod_uid=bounded(event.pod.uid),
                    container=bounded(event.container.name),
                    reason=f"resctrl: class group of {event.level} is missing",
                )
            return EMPTY_SETTINGS
        hooks: tuple[OciHookSpec, ...] = ()
        mon = cfg.monitor_hook
        if placement.pod_group and mon.enabled and self._fs.has_monitor(group):
            args = (HOOK_PROGRAM, "resctrl-join", "--root", cfg.root, "--group", group)
            hooks = (OciHookSpec(HookStage.PRESTART, mon.path,
                                 args + (("--strict",) if mon.strict else ()),
                                 timeout_s=mon.timeout_s),)
        return ContainerSettings(rdt_class=group, hooks=hooks)

    def _planned(self, event: ContainerEvent, cfg: ResctrlConfig) -> str | None:
        """The pod's planned group, kept per pod while the configuration, the pod's level and
        its annotations stay the same: a plan parses the annotation, tens of microseconds that
        would otherwise be spent again for every container of the pod."""
        pod = event.pod
        key = (cfg, event.level, pod.annotations.get(cfg.annotation),
               pod.annotations.get(KOORDINATOR_ANNOTATION))
        kept = self._plans.get(pod.uid)
        if kept is not None and kept[0][0] is cfg and kept[0][1:] == key[1:]:
            return kept[1]
        group = plan_pod_group(pod, event.level, cfg, self._fs.info).group
        if len(self._plans) >= MAX_PLANS_KEPT:
            self._plans.clear()
        self._plans[pod.uid] = (key, group)
        return group

    def synchronize(self, pods: Sequence[PodInfo], containers: Sequence[ContainerInfo]) -> None:
        """The runtime's whole list: the pod groups of pods it no longer runs go. A pod removed
        while the plugin was not connected (a runtime restart, the agent's own restart) got no
        RemovePodSandbox, and with the reconciler off no task-id loop collects its group: it
        would keep a CLOS for good. No sandbox is created between the list and the events after
        it, so a pod not listed has no group to keep."""
        listed = {pod.uid for pod in pods}
        with self._lock:
            if not self._cfg.enabled:
                return
            for group in self._fs.our_groups():
                ref = parse_group_name(self._fs.prefix, group, LEVEL_NAMES)
                if ref is None or ref.kind != "pod" or ref.key in listed:
                    continue
                try:
                    self._fs.remove_group(group, reason=f"pod {ref.key} is gone (the runtime "
                                                        "no longer lists it)")
                except OSError as exc:
                    # EBUSY and the like: the task-id loop, where it runs, tries again.
                    log.warning("resctrl_group_not_removed", group=group,
                                error=removal_problem(exc))
        self._plans = {uid: plan for uid, plan in self._plans.items() if uid in listed}

    def remove_pod_sandbox(self, event: PodEvent) -> None:
        pod = event.pod
        self._plans.pop(pod.uid, None)
        own = pod_group_name(self._cfg.group_prefix, pod.uid)
        if own is None:
            return
        with self._lock:
            # The sandbox being removed is still in the node state until this event is done.
            if any(view.info.uid == pod.uid and sandbox != pod.id
                   for sandbox, view in self._state.snapshot().pods.items()):
                return
            self._fs.remove_group(own, reason=f"pod {pod.uid} removed")
