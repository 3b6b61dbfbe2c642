"""``nri-qos probe``: what the agent sees on this host, and which features will run.

Runs the host probe the agent runs at start (no runtime connection needed) and reports it with,
for every feature of the node configuration, whether it will run and, if not, why. ``--json``
prints one object with at least ``memory_total_bytes`` (what node-wide limits use),
``numa_nodes``, ``cgroup``, ``resctrl``, ``psi``, ``features`` and ``warnings``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from nri_plugin.agent import probe
from nri_plugin.config.loader import ConfigError
from nri_plugin.config.schema import Config
from nri_plugin.config.store import load_config
from nri_plugin.logs import LoggingSetup
from reconciler.audit import AuditLog, MemoryAuditSink
from reconciler.detection.config import (
    FULFILLMENT,
    KSWAPD,
    NUMA_FREE,
    PRESSURE_LEVEL,
    PSI,
    RSS_OVERUSE,
    SYSTEM_FREE,
)
from reconciler.detection.service import pressure_level_problem, psi_path
from reconciler.host.probe import HostInfo, TriggerSupport
from reconciler.k8s import build_api_client
from reconciler.mitigation.drop_cache import drop_cache_problem, drop_file


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
    where = "the machine's meminfo (the NUMA view does not add up)" \
        if not host.numa_view.consistent \
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
    if not host.numa_nodes:
        return Feature(False, "no NUMA nodes in sysfs: system_free covers the machine")
    return Feature(True, f"free memory of {len(host.numa_nodes)} NUMA node(s) vs their "
                         "watermarks")


def _psi(cfg: Config, host: HostInfo) -> Feature:
    path, reason = psi_path(cfg.detection, host)
    pods = "; each online pod's memory.pressure" if host.cgroup.v2 else ""
    return Feature(path != "off", f"{reason}{pods}")


def _pressure_level(cfg: Config, host: HostInfo) -> Feature:
    problem = pressure_level_problem(host)
    if problem:
        return Feature(False, problem)
    return Feature(True, "eventfds on the root memcg and kubelet's pods and burstable cgroups "
                         f"({cfg.detection.pressure_level_mode})")


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
    if not cfg.kubernetes.enabled or build_api_client(cfg.kubernetes) is None:
        return Feature(False, "no Kubernetes API access: audited as skipped")
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


def _kubernetes(cfg: Config, host: HostInfo) -> Feature:
    if not cfg.kubernetes.enabled:
        return Feature(False, "kubernetes.enabled is false: NRI data only")
    if build_api_client(cfg.kubernetes) is None:
        return Feature(False, "no usable API credentials (in-cluster or kubeconfig): no pod "
                              "priorities or requests, no taints, no evictions")
    return Feature(True, "credentials found (not contacted by the probe)")


FEATURES: dict[str, Callable[[Config, HostInfo], Feature]] = {
    "resctrl": _resctrl,
    "memory_qos": _memory_qos,
    "oom_score": _oom,
    "oci_hooks": _oci_hooks,
    "reconciler.drift": _loop(lambda c: c.memory.enabled or c.oom.enabled, "drift repair"),
    "reconciler.resctrl_tasks": _resctrl_tasks,
    "reconciler.memory_guard": _memory_guard,
    "reconciler.numa_binding": _numa_binding,
    "detection.system_free": _detector(SYSTEM_FREE, _always(
        "MemFree of /proc/meminfo vs max(floor, total x watermark_scale_factor, zones' low)")),
    "detection.numa_free": _detector(NUMA_FREE, _numa_free),
    "detection.psi": _detector(PSI, _psi),
    "detection.pressure_level": _detector(PRESSURE_LEVEL, _pressure_level),
    "detection.kswapd": _detector(KSWAPD, _always("pgsteal_kswapd rate from /proc/vmstat")),
    "detection.rss_overuse": _detector(RSS_OVERUSE, _always(
        "anonymous memory of shared/reclaimed pods vs request x factor")),
    "detection.fulfillment": _detector(FULFILLMENT, _always(
        "the memory guard's cap vs the reclaimed pods' requests")),
    "mitigation.taint": _rung("taint", _taint),
    "mitigation.tune": _rung("tune", _tune),
    "mitigation.drop_cache": _rung("drop_cache", _drop_cache),
    "mitigation.evict": _rung("evict", _evict),
    "reconciler.eviction": _eviction,
    "kubernetes": _kubernetes,
}
"""Every feature the probe reports on, with the check that says whether it runs here."""


def _trigger(support: TriggerSupport | None) -> dict[str, Any] | None:
    if support is None:
        return None
    return {"path": support.path, "accepted": support.window_us is not None,
            "window_us": support.window_us, "problem": support.problem or None}


def report(cfg: Config, host: HostInfo) -> dict[str, Any]:
    """The probe's findings as one JSON-ready object."""
    resctrl: dict[str, Any] = {"mounted": host.resctrl is not None,
                               "problem": host.resctrl_problem or None}
    if host.resctrl is not None:
        info = host.resctrl
        resctrl.update(num_closids=info.num_closids, l3=info.has_l3, l3_cache_ids=info.l3_ids,
                       cbm_mask=f"{info.cbm_mask:x}", mba=info.has_mb, mb_cache_ids=info.mb_ids,
                       mb_absolute=info.mb_absolute, monitoring=info.monitoring)
    return {
        "kernel": host.kernel,
        "root": host.root,
        "memory_total_bytes": host.memory_total_bytes,
        "meminfo_total_bytes": host.meminfo_total_bytes,
        "numa_nodes": [{"id": n.id, "total_bytes": n.total_bytes, "free_bytes": n.free_bytes,
                        "low_watermark_bytes": n.low_watermark_bytes} for n in host.numa_nodes],
        "numa_view_consistent": host.numa_view.consistent,
        "cgroup": {"version": host.cgroup.version, "driver": host.cgroup.driver,
                   "mount": host.cgroup.mount},
        "memcg": asdict(host.memcg),
        "resctrl": resctrl,
        "psi": {"readable": host.psi.readable, "system_trigger": _trigger(host.psi.system),
                "cgroup_trigger": _trigger(host.psi.cgroup)},
        "features": {name: asdict(check(cfg, host)) for name, check in FEATURES.items()},
        "warnings": list(host.warnings),
    }


def _print(found: dict[str, Any], out: TextIO) -> None:
    cgroup = found["cgroup"]
    out.write(f"kernel            {found['kernel']}\n")
    out.write(f"cgroup            v{cgroup['version']}, {cgroup['driver']} driver\n")
    out.write(f"memory            {found['memory_total_bytes']} bytes for node-wide limits\n")
    for node in found["numa_nodes"]:
        out.write(f"  NUMA node {node['id']:<5} {node['total_bytes']} bytes, "
                  f"{node['free_bytes']} free, low watermark {node['low_watermark_bytes']}\n")
    knobs = [name for name, present in found["memcg"].items() if present is True]
    out.write(f"memcg knobs       {', '.join(knobs) or 'none'} (in {found['memcg']['where']})\n")
    resctrl = found["resctrl"]
    out.write("resctrl           " + (f"{resctrl['num_closids']} CLOS, L3 {resctrl['l3']}, MBA "
                                     f"{resctrl['mba']}, monitoring {resctrl['monitoring']}"
                                     if resctrl["mounted"] else f"off: {resctrl['problem']}")
              + "\n")
    psi = found["psi"]
    trigger = psi["system_trigger"]
    out.write(f"PSI               {'readable' if psi['readable'] else 'not available'}; "
              + (f"triggers accepted (window {trigger['window_us']} us)" if trigger["accepted"]
                 else f"triggers refused: {trigger['problem']}") + "\n")
    out.write("features\n")
    for name, feature in found["features"].items():
        mark = "on " if feature["runs"] else "off"
        out.write(f"  {mark} {name:<26} {feature['detail']}\n")
    for warning in found["warnings"]:
        out.write(f"warning: {warning}\n")


def main_probe(config_path: str | None, *, as_json: bool, out: TextIO = sys.stdout) -> int:
    # Only errors on stderr: the findings are the output. The probe changes nothing on the host,
    # so it has nothing to audit either.
    logging_setup = LoggingSetup(level="error")
    try:
        try:
            cfg, _ = load_config(config_path)
        except ConfigError as exc:
            for error in exc.errors:
                sys.stderr.write(f"{exc.source or config_path}: {error}\n")
            return 2
        host, _ = probe(cfg, AuditLog(MemoryAuditSink()))
        found = report(cfg, host)
    finally:
        logging_setup.close()
    if as_json:
        out.write(json.dumps(found, indent=2, sort_keys=True) + "\n")
    else:
        _print(found, out)
    return 0
