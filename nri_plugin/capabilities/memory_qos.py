"""The memory QoS capability: memcg settings at CreateContainer (:mod:`hooks.memory_qos`)."""

from __future__ import annotations

from common.audit import AuditLog
from hooks.events import Event
from hooks.memory_qos import MemoryConfig, memory_settings
from hooks.settings import EMPTY_SETTINGS, ContainerSettings
from nri_plugin.capabilities.reporting import Reporting
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability, ContainerEvent


class MemoryQosCapability(Reporting, Capability):
    """``memory_total`` (bytes) stands in for the limit of a container without one, unless the
    config sets ``node_allocatable_bytes``; the drift loop uses the same figure."""

    name = capability = "memory_qos"
    events = inline_events = frozenset({Event.CREATE_CONTAINER})

    def __init__(self, cfg: MemoryConfig, audit: AuditLog, *, strict: bool, cgroup_v2: bool,
                 memory_total: int) -> None:
        super().__init__(audit, strict)
        self._cfg = cfg
        self._v2 = cgroup_v2
        self._memory_total = memory_total
        self._allocatable = cfg.node_allocatable_bytes or memory_total

    def reconfigure(self, config: Config) -> None:
        self._set_strict(config)
        self._cfg = config.memory
        self._allocatable = config.memory.node_allocatable_bytes or self._memory_total

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        if not self._cfg.enabled:
            return EMPTY_SETTINGS
        decision = memory_settings(event.pod, event.container, event.level, self._cfg,
                                   cgroup_v2=self._v2, node_allocatable=self._allocatable)
        self._report(event.pod, event.container.name, decision.problems)
        return decision.settings
