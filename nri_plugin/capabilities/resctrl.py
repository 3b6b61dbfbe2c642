"""The resctrl capability: pod groups at RunPodSandbox, the CLOS at CreateContainer, cleanup at
RemovePodSandbox, and the groups following a reload.

Which group a container joins is :func:`hooks.resctrl_groups.place_container`, the same decision
the task-id loop applies to running containers.

A pod's group belongs to the pod (its uid), not to one sandbox: kubelet replaces a pod's sandbox
by running the new one before removing the old one, so the group goes with the last sandbox of
its pod that the node state knows.

A reload switching resctrl off removes every group of ours (their tasks go back to the root
group); any other reload removes the group of a known pod that the pod's plan under the new
configuration no longer gives it, sets each other pod group of a known pod again from its
annotation under the new configuration, and in observe mode gives every pod group the kernel's
default (no limit). The class groups are the daemon's to keep
(:func:`hooks.resctrl_groups.plan_class_groups`).
"""

from __future__ import annotations

import threading

import structlog

from common.audit import AuditLog
from common.state import NodeState
from hooks.events import Event
from hooks.levels import LEVEL_NAMES
from hooks.resctrl_annotation import plan_pod_group
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
UNWANTED = "the configuration gives it no group of its own"

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
        """Each pod group as the configuration in force wants it: gone when its pod's plan
        under the new configuration gives the pod no group of its own (pod groups off, another
        annotation key, a request neither its level's share nor the caps admit any longer) or
        another one (another prefix); else in observe mode no limit, and otherwise its pod's
        annotation under the new caps and level shares. The
        plan decides, not the containers: a group is made at RunPodSandbox, before any
        container uses it. A group whose pod is unknown, or that the kernel will not remove
        yet, is the task-id loop's to collect; the problems of an annotation were audited when
        its sandbox ran."""
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
                try:
                    self._fs.remove_group(group, reason=f"pod {ref.key}: {UNWANTED}")
                except OSError as exc:
                    log.warning("resctrl_group_not_removed", group=group,
                                error=removal_problem(exc))
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
        if not self._cfg.enabled:
            return EMPTY_SETTINGS
        placement = place_container(event.pod.uid, event.level, self._cfg, self._fs.has_group)
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
        mon = self._cfg.monitor_hook
        if placement.pod_group and mon.enabled and self._fs.has_monitor(group):
            args = (HOOK_PROGRAM, "resctrl-join", "--root", self._cfg.root, "--group", group)
            hooks = (OciHookSpec(HookStage.PRESTART, mon.path,
                                 args + (("--strict",) if mon.strict else ()),
                                 timeout_s=mon.timeout_s),)
        return ContainerSettings(rdt_class=group, hooks=hooks)

    def remove_pod_sandbox(self, event: PodEvent) -> None:
        pod = event.pod
        own = pod_group_name(self._cfg.group_prefix, pod.uid)
        if own is None:
            return
        with self._lock:
            # The sandbox being removed is still in the node state until this event is done.
            if any(view.info.uid == pod.uid and sandbox != pod.id
                   for sandbox, view in self._state.snapshot().pods.items()):
                return
            self._fs.remove_group(own, reason=f"pod {pod.uid} removed")
