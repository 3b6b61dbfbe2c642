"""Fakes shared by the tests of faults on the runtime's side of the NRI connection."""

from __future__ import annotations

from hooks.events import Event
from hooks.settings import ContainerSettings
from nri_plugin.session.capability import Capability, ContainerEvent


class Quick(Capability):
    """Answers CreateContainer at once with one annotation."""

    name = "quick"
    events = frozenset({Event.CREATE_CONTAINER})

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        return ContainerSettings(annotations={"quick": "yes"})
