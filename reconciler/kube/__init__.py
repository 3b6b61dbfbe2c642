"""The one package that talks to the Kubernetes API server.

What is read or written: this node's pods (list, then watch), evictions of pods (``policy/v1``
Eviction, and a read of the pod when one answers 409) with an Event on the evicted pod, and this
node's taints and status conditions. Each request has a client-side timeout, and the pod watch
also a server-side one, so that no thread outlives a stop by more than one request timeout.

One module per job: :mod:`.config` (settings, the node's name), :mod:`.credentials` (the
in-cluster service account; what a request needs), :mod:`.kubeconfig` and
:mod:`.exec_credential` (a kubeconfig and its exec plugin), :mod:`.transport` (the connection;
the module says why not the ``kubernetes`` client), :mod:`.rest` (sending a request),
:mod:`.client` (building the connection, reading raw responses), :mod:`.errors` (what a failure
means), :mod:`.threads` (where the blocking calls run: a named pool of the caller's own,
for the watch and the writes alike; the module says why not ``asyncio.to_thread``),
:mod:`.watch` (the pod watch), :mod:`.evictions`, :mod:`.node` and :mod:`.events` (the
writes), :mod:`.actions` (the writes behind one handle). The rest of the agent imports from
this package, not from its modules.

Without usable credentials the agent runs degraded: :func:`build_api_client` returns ``None``
after one warning, the pod watch idles until stop, and actions report ``unavailable``.
"""

from reconciler.kube.actions import KubeActions
from reconciler.kube.client import build_api_client
from reconciler.kube.config import KubernetesConfig, node_name
from reconciler.kube.events import PodRef
from reconciler.kube.evictions import MIN_GRACE_S, EvictionOutcome, EvictionResult
from reconciler.kube.node import NODE_UPDATE_ATTEMPTS, NodeOutcome
from reconciler.kube.transport import Api
from reconciler.kube.watch import PodWatcher

__all__ = [
    "MIN_GRACE_S",
    "NODE_UPDATE_ATTEMPTS",
    "Api",
    "EvictionOutcome",
    "EvictionResult",
    "KubeActions",
    "KubernetesConfig",
    "NodeOutcome",
    "PodRef",
    "PodWatcher",
    "build_api_client",
    "node_name",
]
