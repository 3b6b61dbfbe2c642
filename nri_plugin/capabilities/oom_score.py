"""The oom score capability: oom_score_adj at CreateContainer (:mod:`hooks.oom_score`)."""

from __future__ import annotations

from common.audit import AuditLog
from hooks.events import Event
from hooks.oom_score import OomConfig, oom_score
from hooks.settings import EMPTY_SETTINGS, ContainerSettings
from nri_plugin.capabilities.reporting import Reporting
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability, ContainerEvent


class OomScoreCapability(Reporting, Capability):
    name = capability = "oom_score"
    events = inline_events = frozenset({Event.CREATE_CONTAINER})

    def __init__(self, cfg: OomConfig, audit: AuditLog, *, strict: bool) -> None:
        super().__init__(audit, strict)
        self._cfg = cfg

    def reconfigure(self, config: Config) -> None:
        self._set_strict(config)
        self._cfg = config.oom

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        if not self._cfg.enabled:
            return EMPTY_SETTINGS
        decision = oom_score(event.pod, event.container, event.level, self._cfg)
        self._report(event.pod, event.container.name, decision.problems)
        return decision.settings
