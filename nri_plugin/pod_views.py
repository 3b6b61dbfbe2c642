"""Each pod sandbox's view and QoS level, worked out once per sandbox rather than per event.

CRI fixes a sandbox's name, labels, annotations and cgroup parent when it creates the sandbox;
later updates only touch its resources, which :class:`~hooks.model.PodInfo` does not carry. So
what is derived from them holds for the sandbox's life, and the CreateContainer of every
container of a pod can reuse what its RunPodSandbox (or its first container) worked out. The level
is worked out again when the ``[qos]`` section changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from hooks.model import PodInfo
from hooks.qos_level import LevelDecision, resolve_level
from nri_plugin.config.schema import QosConfig
from nri_plugin.convert import pod_info
from protos import nri_api_pb2 as api

DEFAULT_LIMIT = 4096
"""Sandboxes remembered at most: far above any node's pod count, so only sandboxes whose removal
was never seen (e.g. while disconnected) are ever pushed out."""


@dataclass(frozen=True, slots=True)
class PodView:
    pod: PodInfo
    decision: LevelDecision
    qos: QosConfig


class PodViews:
    """Sandbox id -> :class:`PodView`, oldest pushed out first beyond ``limit``."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self._limit = limit
        self._views: dict[str, PodView] = {}

    def __len__(self) -> int:
        return len(self._views)

    def view(self, message: api.PodSandbox, qos: QosConfig) -> PodView:
        """The sandbox's view, converted and resolved at its first sight (or when ``qos`` is not
        the section it was resolved with). Raises :class:`~nri_plugin.convert.InvalidInput`."""
        known = self._views.get(message.id)
        if known is not None and known.qos is qos:
            return known
        pod = known.pod if known is not None else pod_info(message)
        view = PodView(pod, resolve_level(pod, qos), qos)
        if known is None and len(self._views) >= self._limit:
            del self._views[next(iter(self._views))]
        self._views[pod.id] = view
        return view

    def forget(self, pod_id: str) -> None:
        self._views.pop(pod_id, None)

    def clear(self) -> None:
        self._views.clear()
