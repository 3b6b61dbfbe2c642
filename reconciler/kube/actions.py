"""Every write the agent makes to the API, behind one handle: evictions (with an Event on the
pod), node taints and node status conditions."""

from __future__ import annotations

from common.audit import AuditLog
from common.podmeta import OwnerRef
from reconciler.kube.config import KubernetesConfig
from reconciler.kube.events import PodEvents, PodRef
from reconciler.kube.evictions import EvictionResult, Evictions
from reconciler.kube.node import NodeOutcome, NodeWriter
from reconciler.kube.rest import Rest
from reconciler.kube.threads import ApiThreads
from reconciler.kube.transport import Api

# The writes one pressure episode makes at once (an eviction, its Event, a taint, a condition)
# run side by side; more would only queue at the API server.
ACTION_THREADS = 4


class KubeActions:
    """Writes to the API: evictions (with an Event on the pod), node taints and node status
    conditions; evictions and taints are audited here, conditions by their owner."""

    def __init__(self, api: Api | None, cfg: KubernetesConfig, audit: AuditLog) -> None:
        # One API handle for every write; None in degraded mode.
        rest = None if api is None else Rest(api)
        threads = ApiThreads("kube-actions", ACTION_THREADS)
        self._evictions = Evictions(rest, cfg, audit, threads)
        self._node = NodeWriter(rest, cfg, audit, threads)
        self._events = PodEvents(rest, cfg, threads)
        self._available = rest is not None

    @property
    def available(self) -> bool:
        """False in degraded mode: every write reports ``unavailable``."""
        return self._available

    async def evict(
        self,
        namespace: str,
        name: str,
        grace_seconds: int | None,
        dry_run: bool,
        *,
        uid: str | None = None,
        reason: str = "unspecified",
    ) -> EvictionResult:
        """Asks the Eviction API to evict a pod; ``dry_run`` sends ``dryRun=All``. ``uid``: the
        pod the decision was about, sent as a precondition so that a pod re-created under the
        same name in the meantime is not the one evicted (the API answers 409; the pod is then
        read back: another uid or none is ``gone``, the same one ``failed``, as a 409 is that
        says nothing of the pod). The result carries the answer's ``Retry-After``, bounded.
        A grace period below :data:`~reconciler.kube.evictions.MIN_GRACE_S` is a programming
        error."""
        return await self._evictions.evict(namespace, name, grace_seconds, dry_run, uid=uid,
                                           reason=reason)

    async def owner_exists(self, namespace: str, owner: OwnerRef) -> bool | None:
        """Whether the DaemonSet ``owner`` names exists with that uid, as ``kubectl drain``
        checks before treating a pod as a DaemonSet's; None when the API could not tell."""
        return await self._evictions.owner_exists(namespace, owner)

    async def create_pod_event(self, pod: PodRef, node: str, reason: str,
                               message: str) -> bool:
        """Records a Warning Event on the pod (``kubectl describe pod`` shows it); False when it
        could not be written (logged, never raised: the Event only tells what happened)."""
        return await self._events.create_pod_event(pod, node, reason, message)

    async def add_taint(
        self, node: str, key: str, value: str, effect: str, *, reason: str = "unspecified"
    ) -> NodeOutcome:
        """Puts ``key=value:effect`` on the node, replacing a taint with the same key and effect."""
        return await self._node.add_taint(node, key, value, effect, reason=reason)

    async def remove_taint(
        self, node: str, key: str, *, reason: str = "unspecified"
    ) -> NodeOutcome:
        """Removes every taint with ``key`` (whatever its value and effect) from the node."""
        return await self._node.remove_taint(node, key, reason=reason)

    async def set_node_condition(
        self, node: str, condition: str, status: bool, reason: str, message: str
    ) -> NodeOutcome:
        """Makes the node's ``status.conditions`` hold ``condition`` with ``status``, ``reason``
        and ``message``; nothing is written when it already does. ``lastTransitionTime`` moves
        only when the status changes, ``lastHeartbeatTime`` with every write."""
        return await self._node.set_node_condition(node, condition, status, reason, message)

    async def remove_node_condition(self, node: str, condition: str) -> NodeOutcome:
        """Takes ``condition`` off the node's ``status.conditions`` (UNCHANGED when it is not
        there): what an uninstall leaves, rather than a condition set False."""
        return await self._node.remove_node_condition(node, condition)
