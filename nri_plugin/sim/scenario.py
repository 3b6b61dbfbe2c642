"""Scenario files of the runtime simulator: the runtime to impersonate, pods, containers, steps.

A scenario is TOML, checked with the same loader as the node configuration (unknown keys are
rejected with their full path). Labels and annotations are written as ``"key=value"`` strings,
since Kubernetes keys contain ``/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hooks.config_fields import section, setting
from hooks.events import Event
from nri_plugin.config.loader import ConfigError, load_file

STEP_EVENTS = tuple(event.name.lower() for event in Event)
DEFAULT_SCENARIO = Path(__file__).with_name("default_scenario.toml")


def _pairs(value: Any) -> str | None:
    bad = [item for item in value if "=" not in item or item.startswith("=")]
    return f"entries must look like key=value, got {', '.join(map(repr, bad))}" if bad else None


def pairs(items: tuple[str, ...]) -> Mapping[str, str]:
    """``("a=1", "b=2")`` -> ``{"a": "1", "b": "2"}``."""
    return MappingProxyType(dict(item.split("=", 1) for item in items))


@dataclass(frozen=True, slots=True)
class RuntimeSpec:
    name: str = setting("containerd", "runtime_name sent in Configure.")
    version: str = setting("v2.4.0", "runtime_version sent in Configure.")
    nri_version: str = setting(
        "v0.12.2",
        "NRI_version sent in Configure; empty impersonates a runtime before NRI 0.12, whose NRI "
        "version the plugin must infer from the runtime version.",
    )
    request_timeout_ms: int = setting(
        2000, "request_timeout sent in Configure and applied to every call; 0 sends nothing "
        "(as NRI before 0.7) and applies 2000.", unit="milliseconds", minimum=0, maximum=600_000,
    )
    registration_timeout_ms: int = setting(
        5000, "registration_timeout sent in Configure and applied to RegisterPlugin.",
        unit="milliseconds", minimum=0, maximum=600_000,
    )
    sync_chunk: int = setting(
        0, "Split Synchronize into chunks of this many pods and containers each (more = true); "
        "0 sends one message.", minimum=0, maximum=1_000_000,
    )


@dataclass(frozen=True, slots=True)
class PodSpec:
    id: str = setting("", "Sandbox id.")
    uid: str = setting("", "Kubernetes pod uid.")
    name: str = setting("", "Pod name.")
    namespace: str = setting("default", "Pod namespace.")
    labels: tuple[str, ...] = setting((), "Labels, key=value.", check=_pairs)
    annotations: tuple[str, ...] = setting((), "Annotations, key=value.", check=_pairs)
    cgroup_parent: str = setting("", "CRI cgroup parent, e.g. /kubepods/besteffort/pod<uid>.")
    existing: bool = setting(False, "Already running at connect time: sent in Synchronize.")


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    id: str = setting("", "Container id.")
    pod: str = setting("", "Sandbox id of its pod.")
    name: str = setting("", "Container name.")
    memory_limit: int = setting(0, "Memory limit; 0 means none.", unit="bytes", minimum=0,
                                maximum=1 << 60)
    memory_min: int = setting(0, "unified memory.min (cgroup v2 MemoryQoS); 0 means none.",
                              unit="bytes", minimum=0, maximum=1 << 60)
    oom_score_adj: int | None = setting(None, "kubelet's oom_score_adj.", minimum=-1000,
                                        maximum=1000)
    env: tuple[str, ...] = setting((), "Environment, KEY=VALUE.", check=_pairs)
    labels: tuple[str, ...] = setting((), "Labels, key=value.", check=_pairs)
    annotations: tuple[str, ...] = setting((), "Annotations, key=value.", check=_pairs)
    existing: bool = setting(False, "Already running at connect time: sent in Synchronize.")


@dataclass(frozen=True, slots=True)
class Step:
    event: str = setting("create_container", "NRI event to send.", choices=STEP_EVENTS)
    pod: str = setting("", "Sandbox id (pod events).")
    container: str = setting("", "Container id (container events).")
    memory_limit: int = setting(
        0, "update_container: the requested new memory limit; 0 keeps it.", unit="bytes",
        minimum=0, maximum=1 << 60,
    )


@dataclass(frozen=True, slots=True)
class Scenario:
    runtime: RuntimeSpec = section(RuntimeSpec, "The runtime to impersonate.")
    pods: tuple[PodSpec, ...] = setting((), "Pods.")
    containers: tuple[ContainerSpec, ...] = setting((), "Containers.")
    steps: tuple[Step, ...] = setting((), "Events, played in order.")

    def validate(self) -> list[tuple[str, str]]:
        problems: list[tuple[str, str]] = []
        pod_ids = {pod.id for pod in self.pods}
        container_ids = {container.id for container in self.containers}
        for i, pod in enumerate(self.pods):
            if not pod.id:
                problems.append((f"pods[{i}].id", "must not be empty"))
        for i, container in enumerate(self.containers):
            if not container.id:
                problems.append((f"containers[{i}].id", "must not be empty"))
            if container.pod not in pod_ids:
                problems.append((f"containers[{i}].pod", f"no pod with id {container.pod!r}"))
        for i, step in enumerate(self.steps):
            if Event[step.event.upper()] in _POD_STEP_EVENTS:
                if step.pod not in pod_ids:
                    problems.append((f"steps[{i}].pod", f"no pod with id {step.pod!r}"))
            elif step.container not in container_ids:
                problems.append((f"steps[{i}].container",
                                 f"no container with id {step.container!r}"))
        return problems


_POD_STEP_EVENTS = frozenset({
    Event.RUN_POD_SANDBOX, Event.STOP_POD_SANDBOX, Event.REMOVE_POD_SANDBOX,
    Event.UPDATE_POD_SANDBOX, Event.POST_UPDATE_POD_SANDBOX,
})


def load_scenario(path: Path | None = None) -> Scenario:
    """Load and check a scenario file (the bundled default when ``path`` is None)."""
    scenario = load_file(Scenario, path or DEFAULT_SCENARIO)
    if not isinstance(scenario, Scenario):
        raise ConfigError(["not a scenario"], str(path))
    return scenario
