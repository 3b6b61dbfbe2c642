"""The capability interface: what the NRI stub calls, in order, for each event.

A :class:`Capability` (resctrl, memory QoS, oom score, OCI hooks, the node-state feed) declares
the events it needs (the plugin's subscription mask is derived from the capabilities actually
enabled) and overrides the matching methods. Capabilities are synchronous: the stub runs them in
a worker thread under the handler deadline (:mod:`nri_plugin.session.chain`), so one that
blocks on a slow kernel file cannot hold up the event loop, and a deadline can still answer
with what is done.

The thread hop costs a few hundred microseconds on a small node, a large share of a
CreateContainer answer. A capability whose handler for an event only computes (in-memory work and
at most ``stat`` calls on kernel filesystems: nothing that can wait on a lock, a device or the
network) lists that event in ``inline_events``; when every capability of an event does, the stub
runs them on the event loop directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo, RuntimeInfo
from hooks.settings import EMPTY_SETTINGS, ContainerSettings
from nri_plugin.config.schema import Config


@dataclass(frozen=True, slots=True)
class PodEvent:
    pod: PodInfo
    level: str
    runtime: RuntimeInfo


@dataclass(frozen=True, slots=True)
class ContainerEvent:
    pod: PodInfo
    container: ContainerInfo
    level: str
    runtime: RuntimeInfo


class Capability:
    """Base class of a capability; every method defaults to doing nothing."""

    name: str = "capability"
    events: frozenset[Event] = frozenset()
    inline_events: frozenset[Event] = frozenset()

    def run_pod_sandbox(self, event: PodEvent) -> None:
        """Called at RunPodSandbox. Raising fails open (or the pod, in strict mode)."""

    def remove_pod_sandbox(self, event: PodEvent) -> None:
        """Called at RemovePodSandbox."""

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        """Return this capability's part of the container's settings."""
        return EMPTY_SETTINGS

    def observe(self, event: Event, pod: PodInfo, container: ContainerInfo | None) -> None:
        """Any other subscribed event (start, stop, remove, update ...): bookkeeping only."""

    def synchronize(self, pods: Sequence[PodInfo], containers: Sequence[ContainerInfo]) -> None:
        """The runtime's complete view after (re)connecting."""

    def reconfigure(self, config: Config) -> None:
        """A reloaded configuration is in force; take its values for the next event."""
