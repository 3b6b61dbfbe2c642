"""The agent's own pod in the colocation benchmark's agent modes (bench/colocation_plan.py AGENT,
bench/colocation_agent.py): the DaemonSet's namespace and resources, and the pod and container
the runtime lists at Synchronize."""

from __future__ import annotations

from pathlib import Path

import yaml

from bench.colocation_agent import own_messages
from bench.colocation_plan import AGENT
from bench.kubelet_node import Container
from common.podmeta import parse_quantity
from protos import nri_api_pb2 as api

DAEMONSET = Path(__file__).parents[2] / "deploy/kustomize/base/daemonset.yaml"


def test_the_agents_pod_has_the_daemonsets_namespace_requests_and_limit() -> None:
    daemonset = yaml.safe_load(DAEMONSET.read_text())
    container = next(c for c in daemonset["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "nri-qos")
    resources = container["resources"]
    assert AGENT.namespace == daemonset["metadata"]["namespace"]
    assert AGENT.memory_request == parse_quantity(resources["requests"]["memory"])
    assert AGENT.memory_limit == parse_quantity(resources["limits"]["memory"])
    # parse_quantity rounds to whole cores, as the API's Value() does: the milli form is kept.
    assert resources["requests"]["cpu"] == f"{AGENT.cpu_request_milli}m"
    # Burstable (a request below the limit): kubelet puts it in that tier's cgroup.
    assert AGENT.tier == "burstable"


def test_the_runtime_lists_the_agents_container_running_in_its_pods_cgroup() -> None:
    pod_rel = f"kubepods/burstable/pod{AGENT.uid}"
    rel = f"{pod_rel}/{AGENT.container_id}"
    sandbox, own = own_messages(Container(rel, f"/{rel}", pod_rel), 4242)
    assert (sandbox.uid, sandbox.name, sandbox.namespace) == (
        AGENT.uid, AGENT.name, AGENT.namespace)
    assert sandbox.linux.cgroup_parent == f"/{pod_rel}"
    assert (own.id, own.pod_sandbox_id, own.state, own.pid) == (
        AGENT.container_id, sandbox.id, api.CONTAINER_RUNNING, 4242)
    # Where the agent finds the container's files: the cgroup the process runs in.
    assert own.linux.cgroups_path == f"/{rel}"
    assert own.linux.resources.memory.limit.value == AGENT.memory_limit
