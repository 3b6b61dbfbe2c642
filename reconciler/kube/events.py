"""Warning Events on a pod, the way ``kubectl describe pod`` shows what the agent did to it."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import structlog

from reconciler.kube.client import finish, rfc3339_now
from reconciler.kube.config import KubernetesConfig
from reconciler.kube.errors import TRANSPORT, ApiError, describe
from reconciler.kube.rest import Rest, segment
from reconciler.kube.threads import ApiThreads

log = structlog.get_logger("nri_qos.kube")

COMPONENT = "nri-qos"
"""Who the Events and conditions the agent writes come from."""


@dataclasses.dataclass(frozen=True, slots=True)
class PodRef:
    """The pod an Event is about."""

    namespace: str
    name: str
    uid: str


class PodEvents:
    """Writes Events; ``rest`` None: degraded, nothing is written."""

    def __init__(self, rest: Rest | None, cfg: KubernetesConfig, threads: ApiThreads) -> None:
        self._rest = rest
        self._cfg = cfg
        self._threads = threads

    async def create_pod_event(self, pod: PodRef, node: str, reason: str,
                               message: str) -> bool:
        """See :meth:`reconciler.kube.actions.KubeActions.create_pod_event`."""
        if self._rest is None:
            return False
        rest = self._rest
        now = rfc3339_now()
        body: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Event",
            # kubelet's naming: the object's name and a unique hexadecimal suffix
            "metadata": {"name": f"{pod.name}.{time.time_ns():x}", "namespace": pod.namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
                               "name": pod.name, "uid": pod.uid},
            "reason": reason, "message": message, "type": "Warning",
            "source": {"component": COMPONENT, "host": node},
            "reportingComponent": COMPONENT, "reportingInstance": node,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }

        def post() -> None:
            finish(rest.request("POST", f"/api/v1/namespaces/{segment(pod.namespace)}/events",
                                body=body, timeout=self._cfg.request_timeout_s))

        try:
            await self._threads.run(post)
        except (ApiError, *TRANSPORT) as exc:
            log.warning("pod_event_failed", pod=f"{pod.namespace}/{pod.name}", reason=reason,
                        error=describe(exc))
            return False
        return True
