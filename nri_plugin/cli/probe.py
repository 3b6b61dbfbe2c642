"""``nri-qos probe``: what the agent sees on this host, and which features will run.

Runs the host probe the agent runs at start (no runtime connection needed) and reports it with,
for every feature of the node configuration, whether it will run and, if not, why. ``--json``
prints one object with at least ``memory_total_bytes`` (what node-wide limits use),
``numa_nodes``, ``cgroup``, ``resctrl``, ``psi``, ``features`` and ``warnings``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any, TextIO

from common.audit import AuditLog, MemoryAuditSink
from hooks.units import human_bytes
from nri_plugin.agent import probe
from nri_plugin.config.loader import ConfigError
from nri_plugin.config.schema import Config, in_force
from nri_plugin.config.store import load_config
from nri_plugin.obs.logs import LoggingSetup
from nri_plugin.report.features import evaluate, kubernetes_feature
from reconciler.host.probe import HostInfo, TriggerSupport
from reconciler.kube import build_api_client


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
        "mode": cfg.agent.mode,
        "kernel": host.kernel,
        "root": host.root,
        "memory_total_bytes": host.memory_total_bytes,
        "meminfo_total_bytes": host.meminfo_total_bytes,
        "numa_nodes": [{"id": n.id, "total_bytes": n.total_bytes, "free_bytes": n.free_bytes,
                        "low_watermark_bytes": n.low_watermark_bytes,
                        "memory_only": n.memory_only} for n in host.numa_nodes],
        "numa_view_consistent": host.numa_view.consistent,
        # awaiting_kubelet: the driver is auto and kubelet's pods cgroup is not there yet; the
        # agent's reconciler, detection, ladder and eviction wait for it.
        "cgroup": {"version": host.cgroup.version, "driver": host.cgroup.driver,
                   "mount": host.cgroup.mount, "awaiting_kubelet": host.cgroup.awaiting_kubelet},
        "memcg": asdict(host.memcg),
        "resctrl": resctrl,
        "psi": {"readable": host.psi.readable, "system_trigger": _trigger(host.psi.system),
                "cgroup_trigger": _trigger(host.psi.cgroup)},
        "features": {name: asdict(feature) for name, feature in evaluate(
            cfg, host, kubernetes_feature(cfg, build_api_client(cfg.kubernetes) is not None,
                                          "credentials found (not contacted by the probe)"),
        ).items()},
        "warnings": list(host.warnings),
    }


def _print(found: dict[str, Any], out: TextIO) -> None:
    cgroup = found["cgroup"]
    out.write(f"kernel            {found['kernel']}\n")
    out.write(f"cgroup            v{cgroup['version']}, " + (
        "driver not known yet: kubelet has made neither kubepods.slice nor kubepods (the "
        "reconciler waits for it)" if cgroup["awaiting_kubelet"]
        else f"{cgroup['driver']} driver") + "\n")
    out.write(f"mode              {found['mode']}\n")
    out.write(f"memory            {human_bytes(found['memory_total_bytes'])} for node-wide "
              "limits\n")
    for node in found["numa_nodes"]:
        out.write(f"  NUMA node {node['id']:<5} {human_bytes(node['total_bytes'])}, "
                  f"{human_bytes(node['free_bytes'])} free, low watermark "
                  f"{human_bytes(node['low_watermark_bytes'])}"
                  + (", memory only (no CPU): left to the kernel's tiering"
                     if node["memory_only"] else "") + "\n")
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
            for line in exc.lines():
                sys.stderr.write(f"{line}\n")
            return 2
        host, _ = probe(cfg, AuditLog(MemoryAuditSink()))
        # The features as the agent would run them: in observe mode, the actions in dry-run.
        found = report(in_force(cfg), host)
    finally:
        logging_setup.close()
    if as_json:
        out.write(json.dumps(found, indent=2, sort_keys=True) + "\n")
    else:
        _print(found, out)
    return 0
