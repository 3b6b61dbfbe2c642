"""The root of the node configuration and its general sections.

Feature sections live beside this module (:mod:`.creation` for the creation-time hooks,
:mod:`.background` for the reconciler and everything after it); this module assembles them into
:class:`Config`, the one object every component receives.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hooks.levels import LEVEL_NAMES
from nri_plugin.config.background import (
    DetectionConfig,
    EvictionConfig,
    MemoryGuardConfig,
    MitigationConfig,
    NumaConfig,
    ReconcilerConfig,
)
from nri_plugin.config.creation import MemoryConfig, OciHooksConfig, OomConfig, ResctrlConfig
from nri_plugin.config.fields import section, setting

QOS_SOURCES = ("annotation", "katalyst", "koordinator", "volcano", "kubernetes_qos")


def _plugin_name(value: Any) -> str | None:
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", value):
        return f"must match [A-Za-z0-9_.+-]+, got {value!r}"
    return None


def _plugin_index(value: Any) -> str | None:
    if not re.fullmatch(r"[0-9]{2}", value):
        return f"must be exactly two digits, got {value!r}"
    return None


def _levels_only(value: Any) -> str | None:
    bad = sorted({v for v in value.values() if v not in LEVEL_NAMES})
    if bad:
        return f"values must be QoS levels ({', '.join(LEVEL_NAMES)}), got {', '.join(bad)}"
    return None


def _unique(value: Any) -> str | None:
    dupes = sorted({v for v in value if list(value).count(v) > 1})
    return f"duplicate entries: {', '.join(dupes)}" if dupes else None


@dataclass(frozen=True, slots=True)
class PluginConfig:
    name: str = setting("nri-qos", "Plugin name registered with the runtime.", check=_plugin_name)
    index: str = setting(
        "10", "Two-digit plugin index; plugins are called in ascending index order.",
        check=_plugin_index,
    )
    socket: str = setting(
        "/var/run/nri/nri.sock",
        "NRI socket of the runtime (ignored when started by the runtime with NRI_PLUGIN_SOCKET).",
    )
    deadline_ms: int = setting(
        1500,
        "Internal deadline of every event handler. Capped below the runtime's request timeout.",
        unit="milliseconds", minimum=10, maximum=60_000,
    )
    deadline_margin_ms: int = setting(
        250,
        "Safety margin kept between the handler deadline and the runtime's request timeout.",
        unit="milliseconds", minimum=0, maximum=10_000,
    )
    strict: bool = setting(
        False,
        "On invalid input, a failed hook or a missed deadline, answer with an error status "
        "(fails the pod or container) instead of a partial adjustment.",
    )
    register_timeout_ms: int = setting(
        5000, "Budget for the RegisterPlugin call.", unit="milliseconds",
        minimum=100, maximum=60_000,
    )
    reconnect_initial_ms: int = setting(
        500, "First delay before reconnecting after the runtime went away.",
        unit="milliseconds", minimum=10, maximum=600_000,
    )
    reconnect_max_ms: int = setting(
        30_000, "Cap of the exponential reconnect backoff.", unit="milliseconds",
        minimum=10, maximum=3_600_000,
    )

    def validate(self) -> list[tuple[str, str]]:
        if self.reconnect_max_ms < self.reconnect_initial_ms:
            return [("reconnect_max_ms", "must be >= reconnect_initial_ms")]
        return []


@dataclass(frozen=True, slots=True)
class QosConfig:
    sources: tuple[str, ...] = setting(
        QOS_SOURCES,
        "Where a pod's QoS level comes from, tried in this order; the first known value wins.",
        choices=QOS_SOURCES, check=_unique,
    )
    default_level: str = setting(
        "shared_cores", "Level of a pod that no source classifies.", choices=LEVEL_NAMES
    )
    annotation: str = setting("qos.nri-qos.io/level", "Annotation holding a level name.")
    koordinator: Mapping[str, str] = setting(
        {
            "LSE": "dedicated_cores",
            "LSR": "dedicated_cores",
            "LS": "shared_cores",
            "BE": "reclaimed_cores",
            "SYSTEM": "system_cores",
        },
        "koordinator.sh/qosClass (label or annotation) value -> level.",
        check=_levels_only,
    )
    volcano: Mapping[str, str] = setting(
        {
            "LC": "dedicated_cores",
            "HLS": "dedicated_cores",
            "LS": "shared_cores",
            "BE": "reclaimed_cores",
        },
        "volcano.sh/qos-level annotation value -> level.",
        check=_levels_only,
    )
    kubernetes_qos: Mapping[str, str] = setting(
        {
            "guaranteed": "shared_cores",
            "burstable": "shared_cores",
            "besteffort": "reclaimed_cores",
        },
        "Kubernetes QoS class (read from the pod's cgroup parent) -> level.",
        keys=("guaranteed", "burstable", "besteffort"),
        check=_levels_only,
    )


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    enabled: bool = setting(True, "Watch this node's pods and use the Eviction and Node APIs.")
    kubeconfig: str = setting(
        "", "Path of a kubeconfig; empty means in-cluster config, then ~/.kube/config."
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


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    level: str = setting(
        "info", "Log level of the operational log.",
        choices=("debug", "info", "warning", "error"),
    )
    format: str = setting(
        "auto", "auto: JSON when stderr is not a terminal, console otherwise.",
        choices=("auto", "json", "console"),
    )
    audit_file: str = setting(
        "", "Also write audit records (JSON lines) to this file; empty means the log stream only."
    )
    audit_max_bytes: int = setting(
        16 << 20, "Rotate the audit file when it reaches this size.", unit="bytes",
        minimum=4096, maximum=1 << 40,
    )
    audit_backups: int = setting(
        5, "Rotated audit files kept.", minimum=0, maximum=1000,
    )


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    enabled: bool = setting(False, "Serve Prometheus metrics over HTTP.")
    address: str = setting("127.0.0.1", "Listen address of the metrics endpoint.")
    port: int = setting(9464, "Listen port of the metrics endpoint.", minimum=1, maximum=65535)


@dataclass(frozen=True, slots=True)
class Config:
    plugin: PluginConfig = section(PluginConfig, "Connection to the runtime and failure policy.")
    qos: QosConfig = section(QosConfig, "How a pod's QoS level is resolved.")
    resctrl: ResctrlConfig = section(ResctrlConfig, "Intel RDT / AMD QoS through resctrl.")
    memory: MemoryConfig = section(MemoryConfig, "Memory QoS of containers (memcg).")
    oom: OomConfig = section(OomConfig, "oom_score_adj per level and per pod.")
    oci_hooks: OciHooksConfig = section(OciHooksConfig, "OCI hooks injected per level.")
    reconciler: ReconcilerConfig = section(ReconcilerConfig, "Background reconciler.")
    memory_guard: MemoryGuardConfig = section(
        MemoryGuardConfig, "Cap on the memory of the reclaimed tier."
    )
    numa: NumaConfig = section(NumaConfig, "NUMA binding of reclaimed pods.")
    detection: DetectionConfig = section(DetectionConfig, "Memory interference detection.")
    mitigation: MitigationConfig = section(MitigationConfig, "Mitigation ladder.")
    eviction: EvictionConfig = section(EvictionConfig, "Eviction through the Kubernetes API.")
    kubernetes: KubernetesConfig = section(KubernetesConfig, "Kubernetes API access.")
    logging: LoggingConfig = section(LoggingConfig, "Operational log and audit trail.")
    metrics: MetricsConfig = section(MetricsConfig, "Prometheus metrics.")
