"""The agent's own pod in the colocation benchmark's agent modes (bench/colocation_plan.py AGENT,
bench/colocation_agent.py): the DaemonSet's namespace and resources."""

from __future__ import annotations

from pathlib import Path

import yaml

from bench.colocation_plan import AGENT
from bench.kubelet_node import MIB

DAEMONSET = Path(__file__).parents[2] / "deploy/kustomize/base/daemonset.yaml"
UNITS = {"Mi": MIB, "m": 1}


def quantity(text: str) -> int:
    for suffix, unit in UNITS.items():
        if text.endswith(suffix):
            return int(text.removesuffix(suffix)) * unit
    raise ValueError(text)


def test_the_agents_pod_has_the_daemonsets_namespace_requests_and_limit() -> None:
    daemonset = yaml.safe_load(DAEMONSET.read_text())
    container = next(c for c in daemonset["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "nri-qos")
    resources = container["resources"]
    assert AGENT.namespace == daemonset["metadata"]["namespace"]
    assert AGENT.memory_request == quantity(resources["requests"]["memory"])
    assert AGENT.memory_limit == quantity(resources["limits"]["memory"])
    assert AGENT.cpu_request_milli == quantity(resources["requests"]["cpu"])
    # Burstable (a request below the limit): kubelet puts it in that tier's cgroup.
    assert AGENT.tier == "burstable"

