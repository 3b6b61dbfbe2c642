"""Which features run on this host with this configuration, and for each one that does not, why.

One place for the answer ``nri-qos probe`` prints before the agent runs and ``nri-qos status``
reports while it runs. Whether the Kubernetes API is usable is the caller's finding: the probe
looks for credentials, the running agent knows whether its reconciler got a client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hooks.memory_qos import memory_qos_active
from hooks.oci_hooks import level_hooks
from hooks.units import human_bytes
from nri_plugin.config.schema import Config
from reconciler.detection.config import (
    FULFILLMENT,
    KSWAPD,
    NUMA_FREE,
    PRESSURE_LEVEL,
    PSI,
    REFAULT,
    RSS_OVERUSE,
    SYSTEM_FREE,
)
from reconciler.detection.counting import Counting
from reconciler.detection.notified import pressure_level_problem, psi_path
from reconciler.detection.triggers import pod_trigger_problem
from reconciler.host.probe import HostInfo
from reconciler.loops.offload import offload_problem
from reconciler.mitigation.drop_cache import drop_cache_problem, drop_file
from reconciler.mitigation.service import counting


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
    if not memory_qos_active(cfg.memory):
        return Feature(False, "every level's policy is none and memory.volcano_annotation is "
                              "false: nothing to set")
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
    levels = sorted(level for level in cfg.oci_hooks.levels
                    if level_hooks(level, cfg.oci_hooks))
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
    if not cfg.memory_guard.standing(host.cgroup.v2):
        return Feature(True, "no standing cap on the BestEffort tier (memory_guard.standing_cap "
                           f"= {cfg.memory_guard.standing_cap}); it is squeezed while the "
                           "ladder's tune rung asks")
    where = "the machine (the NUMA view does not add up)" if not host.numa_view.consistent \
        else f"{len(host.numa_nodes)} NUMA node(s)"
    return Feature(True, f"caps the BestEffort tier from the free memory of {where}")


def _cpu_idle(cfg: Config, host: HostInfo) -> Feature:
    base = _loop(lambda c: c.cpu_idle.enabled, "idle CPU for the reclaimed tier")(cfg, host)
    if not base.runs:
        return base
    if not host.cpu_idle:
        return Feature(False, "the BestEffort tier's cgroup has no cpu.idle (a kernel before "
                              "5.15, the cpu controller not enabled there, or no tier yet)")
    return Feature(True, "cpu.idle = 1 on the BestEffort tier: offline tasks run on CPU time "
                         "nothing else wants")


def _numa_binding(cfg: Config, host: HostInfo) -> Feature:
    base = _loop(lambda c: c.numa.enabled, "NUMA binding")(cfg, host)
    if base.runs and len(host.numa_nodes) < 2:
        return Feature(False, "one NUMA node: nothing to bind")
    return base


def _numa_balance(cfg: Config, host: HostInfo) -> Feature:
    base = _loop(lambda c: c.numa_balance.enabled, "NUMA balance")(cfg, host)
    if not base.runs:
        return base
    if len(host.numa_nodes) < 2:
        return Feature(False, "one NUMA node: nothing to balance")
    if not host.cgroup.v2:
        return Feature(False, "cgroup v1 is not supported: there a binding's change moves the "
                              "pages (cpuset.memory_migrate) in one go")
    balance = cfg.numa_balance
    mode = "dry-run: decides and audits steps, moves nothing" if balance.dry_run else (
        "moves reclaimed pods' pages off a node under its watermark")
    return Feature(True, f"{mode}; steps of at most {human_bytes(balance.step_bytes)}, killed "
                         f"after {balance.step_deadline_s:g} s, at most "
                         f"{human_bytes(balance.rate_bytes_per_s)}/s")


def _offload(cfg: Config, host: HostInfo) -> Feature:
    problem = offload_problem(host)
    if problem:
        return Feature(False, problem)
    base = _loop(lambda c: c.offload.enabled, "offloading")(cfg, host)
    if not base.runs:
        return base
    off = cfg.offload
    who = "reclaimed_cores containers" + (
        f" and shared_cores ones of pods annotated {off.annotation}=true" if off.shared_cores
        else "")
    swap = f"swap of {host.swap_total_bytes >> 20} MiB" + (", zswap on" if host.zswap else "")
    if not host.swap_total_bytes:
        what = "file cache only: the node has no swap (the kernel cannot reclaim anonymous " \
               "memory without it)"
    elif off.anon:
        what = f"file cache and anonymous memory ({swap}; not of containers whose " \
               "memory.swap.max is 0, nor under a cgroup whose swap is 0 or full)"
    else:
        what = f"file cache only (offload.anon is false), steps bounded by inactive file " \
               f"memory; {swap}: memory.reclaim is not given swappiness= (Linux 6.1 has " \
               "none), so the kernel may still take some anonymous memory"
    mode = "dry-run (decides and audits, writes nothing): " if off.dry_run else ""
    return Feature(True, f"{mode}memory.reclaim of {who}, {what}; at most "
                         f"{off.max_bytes_per_s >> 20} MiB/s; held while the ladder is engaged")


def _resctrl_tasks(cfg: Config, host: HostInfo) -> Feature:
    base = _loop(lambda c: c.resctrl.enabled, "resctrl task ids")(cfg, host)
    if base.runs and host.resctrl is None:
        return Feature(False, host.resctrl_problem or "resctrl is not mounted")
    return base


def _eviction(cfg: Config, host: HostInfo) -> Feature:
    base = _loop(lambda c: c.eviction.enabled, "eviction manager")(cfg, host)
    if not base.runs:
        return base
    evict = cfg.eviction
    mode = "dry-run: decides and audits, writes nothing to the API" if evict.dry_run else (
        "evicts through the Eviction API" + (
            f" (dry-run for {', '.join(evict.dry_run_plugins)})" if evict.dry_run_plugins
            else ""))
    if not cfg.kubernetes.enabled:
        mode += "; kubernetes.enabled is false, so it can only decide and audit"
    return Feature(True, f"{mode}; in-tree plugins {', '.join(evict.plugins) or 'none'}; "
                         f"out-of-tree plugins from {evict.plugin_dir}/*.sock")


def _detector(name: str, what: Callable[[Config, HostInfo], Feature]
              ) -> Callable[[Config, HostInfo], Feature]:
    def check(cfg: Config, host: HostInfo) -> Feature:
        if not cfg.reconciler.enabled:
            return Feature(False, "reconciler.enabled is false")
        if not cfg.detection.enabled:
            return Feature(False, "detection.enabled is false")
        if name in cfg.detection.disabled:
            return Feature(False, f"{name} is in detection.disabled")
        return what(cfg, host)

    return check


def _numa_free(cfg: Config, host: HostInfo) -> Feature:
    if not host.numa_view.consistent:
        return Feature(False, f"{host.numa_view.describe()}: system_free covers the machine")
    if not host.numa_sysfs:
        return Feature(False, "no NUMA nodes in sysfs (the kernel has no NUMA): system_free "
                              "covers the machine")
    return Feature(True, f"free memory of {len(host.numa_nodes)} NUMA node(s) vs their "
                         "watermarks")


def _psi(cfg: Config, host: HostInfo) -> Feature:
    path, reason = psi_path(cfg.detection, host)
    pods = ""
    if host.cgroup.v2 and host.psi.readable and not host.pod_psi:
        pods = ("; the online pods have no memory.pressure (PSI off for cgroups: "
                "cgroup_disable=pressure)")
    elif host.cgroup.v2:
        problem = pod_trigger_problem(cfg, host)
        pods = ("; each online pod's memory.pressure, with a trigger of its own" if not problem
                else f"; each online pod's memory.pressure, without a trigger of its own "
                     f"({problem}): the node's PSI wakes the detectors")
    return Feature(path != "off", f"{reason}{pods}{_ladder_note(cfg, host, 'the node')}")


def _counting(cfg: Config, host: HostInfo) -> Counting:
    return counting(cfg, not pressure_level_problem(host), host.pod_psi, host.pod_refaults)


def _finer(host: HostInfo) -> str:
    """What tells here what online pods feel, finer than the coarser readings."""
    if host.pod_psi:
        return "the online pods' own PSI tells"
    if host.pod_refaults:
        return "the online pods' own refaults tell"
    return "memory.pressure_level tells"


def _ladder_note(cfg: Config, host: HostInfo, what: str) -> str:
    """Why a node-wide reading does not drive the ladder here ("" where it does)."""
    if _counting(cfg, host).node:
        return ""
    return (f"; {what}'s reading is reported but does not drive the ladder "
            f"(mitigation.node_signals {cfg.mitigation.node_signals}: {_finer(host)} what "
            "online pods feel from the offline tier's own reclaim)")


def _node_wide(check: Callable[[Config, HostInfo], Feature], what: str
               ) -> Callable[[Config, HostInfo], Feature]:
    def noted(cfg: Config, host: HostInfo) -> Feature:
        found = check(cfg, host)
        if not found.runs:
            return found
        return Feature(True, found.detail + _ladder_note(cfg, host, what))

    return noted


def _pressure_level(cfg: Config, host: HostInfo) -> Feature:
    problem = pressure_level_problem(host)
    if problem:
        return Feature(False, problem)
    note = "" if _counting(cfg, host).memcg else (
        "; reported and waking the detectors, but not driving the ladder (mitigation."
        f"node_signals {cfg.mitigation.node_signals}: {_finer(host)} whether the reclaim "
        "took online pods' memory)")
    return Feature(True, "eventfds on the root memcg and kubelet's pods and burstable cgroups "
                         f"({cfg.detection.pressure_level_mode}){note}")


def _refault(cfg: Config, host: HostInfo) -> Feature:
    if host.pod_psi:
        return Feature(False, "each online pod's PSI counts its stalls on refaults (cgroup v2)")
    if not host.pod_refaults:
        return Feature(False, "memory.stat has no workingset_refault counters (Linux 5.9+)")
    return Feature(True, "each online pod's working-set refaults per second from its "
                         f"memory.stat, over {cfg.detection.refault_window_s:g} s")


def _fulfillment(cfg: Config, host: HostInfo) -> Feature:
    if cfg.memory_guard.enabled and cfg.memory_guard.standing(host.cgroup.v2):
        return Feature(True, "the memory guard's cap vs the reclaimed pods' requests")
    return Feature(True, "reads nothing here: the memory guard holds no standing cap on the "
                         "BestEffort tier (memory_guard.standing_cap), so only an operator's "
                         "own limit on it would be read")


def _always(detail: str) -> Callable[[Config, HostInfo], Feature]:
    return lambda cfg, host: Feature(True, detail)


def _rung(name: str, what: Callable[[Config, HostInfo], Feature]
          ) -> Callable[[Config, HostInfo], Feature]:
    def check(cfg: Config, host: HostInfo) -> Feature:
        rung = getattr(cfg.mitigation, name)
        if not cfg.reconciler.enabled:
            return Feature(False, "reconciler.enabled is false")
        if not (cfg.mitigation.enabled and rung.enabled):
            return Feature(False, f"mitigation.{name} is switched off")
        found = what(cfg, host)
        if found.runs and rung.dry_run:
            return Feature(True, f"dry-run (decides and audits, writes nothing): {found.detail}")
        return found

    return check


def _taint(cfg: Config, host: HostInfo) -> Feature:
    rung = cfg.mitigation.taint
    return Feature(True, f"taint {rung.key}:{rung.effect} and condition {rung.condition} from "
                         f"level {rung.level}")


def _tune(cfg: Config, host: HostInfo) -> Feature:
    knobs = []
    if cfg.memory_guard.enabled:
        knobs.append("squeeze of the reclaimed tier's " +
                     ("memory.high" if host.cgroup.v2 else "memory limit") + " by the guard")
    if host.memcg.wmark_ratio:
        knobs.append("memory.wmark_ratio of reclaimed pods")
    if not knobs:
        return Feature(False, "memory guard off and no memory.wmark_ratio in this kernel")
    return Feature(True, "; ".join(knobs))


def _drop_cache(cfg: Config, host: HostInfo) -> Feature:
    problem = drop_cache_problem(host)
    if problem:
        return Feature(False, problem)
    return Feature(True, f"{drop_file(host)} of reclaimed pods, largest cache first, from level "
                         f"{cfg.mitigation.drop_cache.level}")


def _evict(cfg: Config, host: HostInfo) -> Feature:
    manager = _eviction(cfg, host)
    if not manager.runs:
        return Feature(False, f"the eviction manager does not run: {manager.detail}")
    return Feature(True, "asks the eviction manager for a round at once")


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
    "reconciler.cpu_idle": _cpu_idle,
    "reconciler.numa_binding": _numa_binding,
    "reconciler.numa_balance": _numa_balance,
    "reconciler.offload": _offload,
    "detection.system_free": _detector(SYSTEM_FREE, _node_wide(_always(
        "MemFree of /proc/meminfo vs max(floor, total x watermark_scale_factor, zones' low)"),
        "the node")),
    "detection.numa_free": _detector(NUMA_FREE, _node_wide(_numa_free, "each NUMA node")),
    "detection.psi": _detector(PSI, _psi),
    "detection.pressure_level": _detector(PRESSURE_LEVEL, _pressure_level),
    "detection.refault": _detector(REFAULT, _refault),
    "detection.kswapd": _detector(KSWAPD, _node_wide(
        _always("pgsteal_kswapd rate from /proc/vmstat"), "kswapd")),
    "detection.rss_overuse": _detector(RSS_OVERUSE, _always(
        "anonymous memory of shared/reclaimed pods vs request x factor")),
    "detection.fulfillment": _detector(FULFILLMENT, _fulfillment),
    "mitigation.taint": _rung("taint", _taint),
    "mitigation.tune": _rung("tune", _tune),
    "mitigation.drop_cache": _rung("drop_cache", _drop_cache),
    "mitigation.evict": _rung("evict", _evict),
    "reconciler.eviction": _eviction,
}
"""Every feature that depends on the configuration and the host, with the check that says
whether it runs here (the Kubernetes API is :func:`kubernetes_feature`; the features that write
to it are off without it, see :func:`evaluate`)."""

NEEDS_KUBERNETES = frozenset({"mitigation.taint"})
"""Features that do nothing without the Kubernetes API (the eviction manager still decides and
audits without it)."""


def evaluate(cfg: Config, host: HostInfo, kubernetes: Feature) -> dict[str, Feature]:
    """Every feature, in a fixed order, the Kubernetes API last."""
    found = {name: check(cfg, host) for name, check in FEATURES.items()}
    for name in NEEDS_KUBERNETES:
        if found[name].runs and not kubernetes.runs:
            found[name] = Feature(False, f"no Kubernetes API ({kubernetes.detail}): audited as "
                                         "skipped")
    found["kubernetes"] = kubernetes
    return found
