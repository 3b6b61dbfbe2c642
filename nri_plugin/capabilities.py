"""The creation-time capabilities as hooks of the NRI chain: resctrl, memory QoS, oom score, OCI
hooks.

Each hook calls its pure policy from :mod:`hooks` and turns the policy's problems into audit
records (``adjustment_skipped``); with ``plugin.strict`` it then raises
:class:`hooks.errors.InvalidInput`, which the stub answers with an error. Only enabled
capabilities are built, so the subscription mask holds only the events they need. A reload
reaches the built hooks through :meth:`~nri_plugin.chain.Hook.reconfigure`; switching a capability
on or off takes effect at the next connection, where the subscription is negotiated again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from hooks.errors import InvalidInput
from hooks.levels import LEVEL_NAMES
from hooks.memory_qos import memory_settings
from hooks.model import ContainerInfo, PodInfo
from hooks.oci_hooks import any_hooks, level_hooks
from hooks.oom_score import oom_score
from hooks.resctrl import (
    KOORDINATOR_ANNOTATION,
    POD_MARK,
    GroupRef,
    class_group_name,
    class_schemata,
    parse_group_name,
    plan_pod_group,
    pod_group_name,
)
from hooks.settings import EMPTY_SETTINGS, ContainerSettings, HookStage, OciHookSpec
from nri_plugin.audit import AuditLog
from nri_plugin.chain import ContainerEvent, Hook, PodEvent
from nri_plugin.config.creation import MemoryConfig, OciHooksConfig, OomConfig, ResctrlConfig
from nri_plugin.config.schema import Config
from nri_plugin.events import Event
from reconciler.resctrlfs import GroupError, ResctrlFs

HOOK_PROGRAM = "nri-qos-hook"


class _Reporting:
    """Shared problem handling: audit every problem, raise under strict handling."""

    capability = ""

    def __init__(self, audit: AuditLog, strict: bool) -> None:
        self._audit = audit
        self._strict = strict

    def _set_strict(self, config: Config) -> None:
        self._strict = config.plugin.strict

    def _report(self, pod: PodInfo, container: str, problems: Sequence[str]) -> None:
        for problem in problems:
            self._audit.record("adjustment_skipped", pod_uid=pod.uid, container=container,
                               reason=f"{self.capability}: {problem}")
        if problems and self._strict:
            raise InvalidInput(self.capability, problems)


class ResctrlHook(_Reporting, Hook):
    """Pod groups at RunPodSandbox, the CLOS at CreateContainer, cleanup at RemovePodSandbox."""

    name = capability = "resctrl"
    events = frozenset({Event.RUN_POD_SANDBOX, Event.CREATE_CONTAINER, Event.REMOVE_POD_SANDBOX})
    # CreateContainer only looks groups up (stat); creating and removing them stays threaded.
    inline_events = frozenset({Event.CREATE_CONTAINER})

    def __init__(self, cfg: ResctrlConfig, fs: ResctrlFs, audit: AuditLog, *,
                 strict: bool) -> None:
        super().__init__(audit, strict)
        self._cfg = cfg
        self._fs = fs
        # pod uid -> group its containers go to (its own group or the fallback class group)
        self._pods: dict[str, str] = {}

    def reconfigure(self, config: Config) -> None:
        self._set_strict(config)
        self._cfg = config.resctrl

    def _class_group(self, level: str) -> str | None:
        lvl = self._cfg.levels.get(level)
        if lvl is None or not lvl.enabled:
            return None
        name = class_group_name(self._cfg.group_prefix, level)
        return name if self._fs.has_group(name) else None

    def _class_names(self) -> list[str]:
        return [class_group_name(self._cfg.group_prefix, level)
                for level, lvl in self._cfg.levels.items() if lvl.enabled]

    def run_pod_sandbox(self, event: PodEvent) -> None:
        plan = plan_pod_group(event.pod, event.level, self._cfg, self._fs.info)
        self._report(event.pod, "", plan.problems)
        if plan.group is None or plan.schemata is None:
            return
        used = self._fs.create_pod_group(
            plan.group, plan.schemata, pod_uid=event.pod.uid,
            class_groups=self._class_names(), fallback=self._class_group(event.level),
        )
        if used is not None:
            self._pods[event.pod.uid] = used

    def _asks_for_group(self, pod: PodInfo) -> bool:
        return self._cfg.annotation in pod.annotations or (
            self._cfg.koordinator_annotation and KOORDINATOR_ANNOTATION in pod.annotations)

    def _pod_group(self, pod: PodInfo) -> str | None:
        """The pod's own group (or the class group it fell back to), if it has one."""
        known = self._pods.get(pod.uid)
        if known is not None and self._fs.has_group(known):
            return known
        if not self._asks_for_group(pod):
            return None
        # Created before a restart of the plugin: the group on disk is the record.
        own = pod_group_name(self._cfg.group_prefix, pod.uid)
        return own if own is not None and self._fs.has_group(own) else None

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        group = self._pod_group(event.pod)
        class_group = self._class_group(event.level) if group is None else None
        if group is None and class_group is None:
            lvl = self._cfg.levels.get(event.level)
            if lvl is not None and lvl.enabled:
                self._audit.record(
                    "adjustment_skipped", pod_uid=event.pod.uid, container=event.container.name,
                    reason=f"resctrl: class group of {event.level} is missing",
                )
            return EMPTY_SETTINGS
        hooks: tuple[OciHookSpec, ...] = ()
        mon = self._cfg.monitor_hook
        if (group is not None and mon.enabled
                and group.startswith(self._cfg.group_prefix + POD_MARK)
                and self._fs.has_monitor(group)):
            args = (HOOK_PROGRAM, "resctrl-join", "--root", self._cfg.root, "--group", group)
            hooks = (OciHookSpec(HookStage.PRESTART, mon.path,
                                 args + (("--strict",) if mon.strict else ()),
                                 timeout_s=mon.timeout_s),)
        return ContainerSettings(rdt_class=group or class_group, hooks=hooks)

    def remove_pod_sandbox(self, event: PodEvent) -> None:
        self._pods.pop(event.pod.uid, None)
        own = pod_group_name(self._cfg.group_prefix, event.pod.uid)
        if own is not None:
            self._fs.remove_group(own, reason=f"pod {event.pod.uid} removed")

    def synchronize(self, pods: Sequence[PodInfo], containers: Sequence[ContainerInfo]) -> None:
        for pod in pods:
            own = pod_group_name(self._cfg.group_prefix, pod.uid)
            if own is not None and self._fs.has_group(own):
                self._pods[pod.uid] = own


class MemoryQosHook(_Reporting, Hook):
    name = capability = "memory_qos"
    events = inline_events = frozenset({Event.CREATE_CONTAINER})

    def __init__(self, cfg: MemoryConfig, audit: AuditLog, *, strict: bool, cgroup_v2: bool,
                 node_allocatable: int) -> None:
        super().__init__(audit, strict)
        self._cfg = cfg
        self._v2 = cgroup_v2
        self._host_allocatable = node_allocatable
        self._allocatable = cfg.node_allocatable_bytes or node_allocatable

    def reconfigure(self, config: Config) -> None:
        self._set_strict(config)
        self._cfg = config.memory
        self._allocatable = config.memory.node_allocatable_bytes or self._host_allocatable

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        decision = memory_settings(event.pod, event.container, event.level, self._cfg,
                                   cgroup_v2=self._v2, node_allocatable=self._allocatable)
        self._report(event.pod, event.container.name, decision.problems)
        return decision.settings


class OomScoreHook(_Reporting, Hook):
    name = capability = "oom_score"
    events = inline_events = frozenset({Event.CREATE_CONTAINER})

    def __init__(self, cfg: OomConfig, audit: AuditLog, *, strict: bool) -> None:
        super().__init__(audit, strict)
        self._cfg = cfg

    def reconfigure(self, config: Config) -> None:
        self._set_strict(config)
        self._cfg = config.oom

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        decision = oom_score(event.pod, event.container, event.level, self._cfg)
        self._report(event.pod, event.container.name, decision.problems)
        return decision.settings


class OciHooksHook(Hook):
    name = "oci_hooks"
    events = inline_events = frozenset({Event.CREATE_CONTAINER})

    def __init__(self, cfg: OciHooksConfig) -> None:
        self._by_level = self._settings(cfg)

    @staticmethod
    def _settings(cfg: OciHooksConfig) -> Mapping[str, ContainerSettings]:
        # The answer depends on the level alone: computed once per configuration.
        return {level: ContainerSettings(hooks=hooks)
                for level in LEVEL_NAMES if (hooks := level_hooks(level, cfg))}

    def reconfigure(self, config: Config) -> None:
        self._by_level = self._settings(config.oci_hooks)

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        return self._by_level.get(event.level, EMPTY_SETTINGS)


def uses_cgroup_v2(cfg: MemoryConfig, detected: bool) -> bool:
    """The config's override, or what the host has."""
    return {"v1": False, "v2": True}.get(cfg.cgroup_version, detected)


def build_hooks(config: Config, *, resctrl: ResctrlFs | None, audit: AuditLog, cgroup_v2: bool,
                node_allocatable: int = 0) -> list[Hook]:
    """The enabled capabilities, in chain order (earlier ones own a field on conflict).

    ``resctrl`` is None when resctrl is unavailable: no CLOS is ever emitted then.
    ``node_allocatable`` (bytes) is the host's memory, used unless the config sets it.
    """
    strict = config.plugin.strict
    hooks: list[Hook] = []
    if config.resctrl.enabled and resctrl is not None:
        hooks.append(ResctrlHook(config.resctrl, resctrl, audit, strict=strict))
    mem = config.memory
    if mem.enabled and (mem.volcano_annotation
                        or any(lvl.policy != "none" for lvl in mem.levels.values())):
        hooks.append(MemoryQosHook(
            mem, audit, strict=strict, cgroup_v2=uses_cgroup_v2(mem, cgroup_v2),
            node_allocatable=node_allocatable,
        ))
    if config.oom.enabled:
        hooks.append(OomScoreHook(config.oom, audit, strict=strict))
    if any_hooks(config.oci_hooks):
        hooks.append(OciHooksHook(config.oci_hooks))
    return hooks


def setup_class_groups(cfg: ResctrlConfig, fs: ResctrlFs, *,
                       warn: Callable[[str], None]) -> Mapping[str, str]:
    """Create or update the class group of every enabled level and remove those of levels that
    are no longer enabled; at startup and on every config reload. Returns level -> group."""
    groups: dict[str, str] = {}
    for level, lvl in cfg.levels.items():
        name = class_group_name(cfg.group_prefix, level)
        if not lvl.enabled:
            continue
        try:
            fs.ensure_group(name, class_schemata(lvl, fs.info), reason="config")
        except (GroupError, OSError) as exc:
            warn(f"resctrl class group {name} unavailable: {exc}")
            continue
        groups[level] = name
    enabled = {level for level, lvl in cfg.levels.items() if lvl.enabled}
    for name in fs.our_groups():
        ref: GroupRef | None = parse_group_name(cfg.group_prefix, name, LEVEL_NAMES)
        if ref is not None and ref.kind == "class" and ref.key not in enabled:
            fs.remove_group(name, reason=f"level {ref.key} disabled")
    return groups


