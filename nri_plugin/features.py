"""Which features run on this host with this configuration, and for each one that does not, why.

One place for the answer ``nri-qos probe`` prints before the agent runs and ``nri-qos status``
reports while it runs. Whether the Kubernetes API is usable is the caller's finding: the probe
looks for credentials, the running agent knows whether its reconciler got a client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nri_plugin.config.schema import Config
from reconciler.host.probe import HostInfo


@dataclass(frozen=True, slots=True)
class Feature:
    runs: bool
    detail: str


def _resctrl(cfg: Config, host: HostInfo) -> Feature:
    if not cfg.resctrl.enabled:
        return Feature(False, "resctrl.enabled is false")
    if host.resctrl is None:
        return Feature(False, host.resctrl_problem or "resctrl is not mounted")
    return Feature(True, f"{host.resctrl.num_closids} CLOS; class groups per level, CLOS ids at "
                         "creation, task ids kept by the reconciler")


def _memory_qos(cfg: Config, host: HostInfo) -> Feature:
    if not cfg.memory.enabled:
        return Feature(False, "memory.enabled is false")
    if host.cgroup.v2:
        return Feature(True, "cgroup v2: memory.min/low/high per container")
    if any(level.v1_reservation for level in cfg.memory.levels.values()):
        return Feature(True, "cgroup v1: memory reservation (soft limit) where v1_reservation")
    return Feature(False, "cgroup v1 has no memory.min/low/high; set v1_reservation on a level "
                          "to use the soft limit")


def _oom(cfg: Config, host: HostInfo) -> Feature:
    if not cfg.oom.enabled:
        return Feature(False, "oom.enabled is false")
    return Feature(True, "in the CreateContainer answer where the runtime applies it (containerd "
                         "1.7.26+), else by the reconciler right after the container starts")


def _oci_hooks(cfg: Config, host: HostInfo) -> Feature:
    levels = sorted(level for level, hooks in cfg.oci_hooks.levels.items()
                    if any(getattr(hooks, stage) for stage in hooks.__dataclass_fields__))
    if not levels:
        return Feature(False, "no hooks configured")
    return Feature(True, f"hooks for {', '.join(levels)}")


def _loop(enabled: Callable[[Config], bool], what: str) -> Callable[[Config, HostInfo], Feature]:
    def check(cfg: Config, host: HostInfo) -> Feature:
        if not cfg.reconciler.enabled:
            return Feature(False, "reconciler.enabled is false")
        if not enabled(cfg):
            return Feature(False, f"{what} is switched off in the configuration")
        return Feature(True, what)

    return check


def _memory_guard(cfg: Config, host: HostInfo) -> Feature:
    base = _loop(lambda c: c.memory_guard.enabled, "memory guard")(cfg, host)
    if not base.runs:
        return base
    where = "/proc/meminfo (the NUMA view does not add up)" if not host.numa_view.consistent \
        else f"{len(host.numa_nodes)} NUMA node(s)"
    return Feature(True, f"caps the BestEffort tier from the free memory of {where}")


def _numa_binding(cfg: Config, host: HostInfo) -> Feature:
    base = _loop(lambda c: c.numa.enabled, "NUMA binding")(cfg, host)
    if base.runs and len(host.numa_nodes) < 2:
        return Feature(False, "one NUMA node: nothing to bind")
    return base


def _resctrl_tasks(cfg: Config, host: HostInfo) -> Feature:
    base = _loop(lambda c: c.resctrl.enabled, "resctrl task ids")(cfg, host)
    if base.runs and host.resctrl is None:
        return Feature(False, host.resctrl_problem or "resctrl is not mounted")
    return base


def kubernetes_feature(cfg: Config, client: bool | None, found: str) -> Feature:
    """The Kubernetes API: ``client`` says whether credentials gave a client (None: not known
    yet); ``found`` describes a usable one."""
    if not cfg.kubernetes.enabled:
        return Feature(False, "kubernetes.enabled is false: NRI data only")
    if client is None:
        return Feature(False, "not set up yet (the reconciler builds the client when it starts)")
    if not client:
        return Feature(False, "no usable API credentials (in-cluster or kubeconfig): no pod "
                              "priorities or requests, no taints, no evictions")
    return Feature(True, found)


FEATURES: dict[str, Callable[[Config, HostInfo], Feature]] = {
    "resctrl": _resctrl,
    "memory_qos": _memory_qos,
    "oom_score": _oom,
    "oci_hooks": _oci_hooks,
    "reconciler.drift": _loop(lambda c: c.memory.enabled or c.oom.enabled, "drift repair"),
    "reconciler.resctrl_tasks": _resctrl_tasks,
    "reconciler.memory_guard": _memory_guard,
    "reconciler.numa_binding": _numa_binding,
}
"""Every feature that depends on the configuration and the host, with the check that says
whether it runs here (the Kubernetes API is :func:`kubernetes_feature`)."""


def evaluate(cfg: Config, host: HostInfo, kubernetes: Feature) -> dict[str, Feature]:
    """Every feature, in a fixed order, the Kubernetes API last."""
    found = {name: check(cfg, host) for name, check in FEATURES.items()}
    found["kubernetes"] = kubernetes
    return found
