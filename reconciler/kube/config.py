"""What the agent is told about the API server, and which node it is."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from hooks.config_fields import setting


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    enabled: bool = setting(True, "Watch this node's pods and use the Eviction and Node APIs.")
    kubeconfig: str = setting(
        "", "Path of one kubeconfig file; empty means in-cluster config, then the first "
        "file of KUBECONFIG that exists, or ~/.kube/config.",
    )
    node_name: str = setting(
        "", "This node's name; empty means the NODE_NAME variable, then the hostname."
    )
    request_timeout_s: float = setting(
        10.0, "Timeout of one API request.", unit="seconds", minimum=0.1, maximum=300
    )
    watch_timeout_s: int = setting(
        300, "Server-side timeout of one pod watch before it is renewed.", unit="seconds",
        minimum=10, maximum=3600,
    )
    retry_max_s: float = setting(
        30.0, "Cap of the backoff between failed list/watch attempts.", unit="seconds",
        minimum=0.1, maximum=600,
    )


def node_name(cfg: KubernetesConfig, environ: Mapping[str, str] | None = None) -> str:
    """This node's name: the config, then ``NODE_NAME``, then the hostname as kubelet spells it."""
    env = os.environ if environ is None else environ
    if cfg.node_name:
        return cfg.node_name
    if env.get("NODE_NAME"):
        return env["NODE_NAME"]
    # kubelet registers the node under the lower-cased hostname unless told otherwise.
    return socket.gethostname().strip().lower()
