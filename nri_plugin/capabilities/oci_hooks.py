"""The OCI hooks capability: the hooks the node config gives a level (:mod:`hooks.oci_hooks`)."""

from __future__ import annotations

from collections.abc import Mapping

from hooks.events import Event
from hooks.levels import LEVEL_NAMES
from hooks.oci_hooks import OciHooksConfig, level_hooks
from hooks.settings import EMPTY_SETTINGS, ContainerSettings
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability, ContainerEvent


class OciHooksCapability(Capability):
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
