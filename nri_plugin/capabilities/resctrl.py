"""The resctrl capability: pod groups at RunPodSandbox, the CLOS at CreateContainer, cleanup at
RemovePodSandbox.

Which group a container joins is :func:`hooks.resctrl_groups.place_container`, the same decision
the task-id loop applies to running containers.
"""

from __future__ import annotations

from common.audit import AuditLog
from hooks.events import Event
from hooks.resctrl_annotation import plan_pod_group
from hooks.resctrl_config import ResctrlConfig
from hooks.resctrl_groups import (
    class_group_name,
    place_container,
    place_in_class_group,
    pod_group_name,
)
from hooks.settings import EMPTY_SETTINGS, ContainerSettings, HookStage, OciHookSpec
from hooks.untrusted import bounded
from nri_plugin.capabilities.reporting import Reporting
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability, ContainerEvent, PodEvent
from reconciler.host.resctrlfs import ResctrlFs

HOOK_PROGRAM = "nri-qos-hook"


class ResctrlCapability(Reporting, Capability):
    name = capability = "resctrl"
    events = frozenset({Event.RUN_POD_SANDBOX, Event.CREATE_CONTAINER, Event.REMOVE_POD_SANDBOX})
    # CreateContainer only looks groups up (stat); creating and removing them stays threaded.
    inline_events = frozenset({Event.CREATE_CONTAINER})

    def __init__(self, cfg: ResctrlConfig, fs: ResctrlFs, audit: AuditLog, *,
                 strict: bool) -> None:
        super().__init__(audit, strict)
        self._cfg = cfg
        self._fs = fs

    def reconfigure(self, config: Config) -> None:
        self._set_strict(config)
        self._cfg = config.resctrl

    def _class_names(self) -> list[str]:
        return [class_group_name(self._cfg.group_prefix, level)
                for level, lvl in self._cfg.levels.items() if lvl.enabled]

    def run_pod_sandbox(self, event: PodEvent) -> None:
        plan = plan_pod_group(event.pod, event.level, self._cfg, self._fs.info)
        self._report(event.pod, "", plan.problems)
        if plan.group is None or plan.schemata is None:
            return
        fallback = place_in_class_group(event.level, self._cfg, self._fs.has_group).group
        self._fs.create_pod_group(plan.group, plan.schemata, pod_uid=event.pod.uid,
                                  class_groups=self._class_names(), fallback=fallback)

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
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
        own = pod_group_name(self._cfg.group_prefix, event.pod.uid)
        if own is not None:
            self._fs.remove_group(own, reason=f"pod {event.pod.uid} removed")
