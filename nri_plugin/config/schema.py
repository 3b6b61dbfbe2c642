"""The node configuration: every section composed into :class:`Config`.

Each section is declared beside the policy or loop that reads it (``hooks/`` for the creation-time
policies, ``reconciler/`` for the background half, :mod:`nri_plugin.obs.logs` for logging); this
module adds the sections of the NRI connection itself and assembles the root, the one object the
daemon loads, reloads and hands down, section by section.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hooks.config_fields import section, setting
from hooks.memory_qos import VOLCANO_ANNOTATION as VOLCANO_COLOCATION_ANNOTATION
from hooks.memory_qos import MemoryConfig
from hooks.model import ReadKeys
from hooks.oci_hooks import OciHook, OciHooksConfig
from hooks.oom_score import OomConfig
from hooks.qos_level import KATALYST_ANNOTATION, KOORDINATOR_KEY, QosConfig
from hooks.qos_level import VOLCANO_ANNOTATION as VOLCANO_QOS_ANNOTATION
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION
from hooks.resctrl_config import ResctrlConfig
from hooks.settings import HookStage
from nri_plugin.config.hook_paths import check_hook_path
from nri_plugin.obs.logs import LoggingConfig
from nri_plugin.scheduling import BATCH, NORMAL
from reconciler.detection.config import DetectionConfig
from reconciler.eviction.choice import READ_ANNOTATIONS as EVICTION_ANNOTATIONS
from reconciler.eviction.config import EvictionConfig
from reconciler.eviction.selector import label_keys
from reconciler.kube import KubernetesConfig
from reconciler.loops.base import ReconcilerConfig
from reconciler.loops.cpu_idle import CpuIdleConfig
from reconciler.loops.memory_guard import MemoryGuardConfig
from reconciler.loops.numa_balance import NumaBalanceConfig
from reconciler.loops.numa_binding import NumaConfig
from reconciler.loops.offload import OffloadConfig
from reconciler.mitigation.config import MitigationConfig


def _plugin_name(value: Any) -> str | None:
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", value):
        return f"must match [A-Za-z0-9_.+-]+, got {value!r}"
    return None


def _plugin_index(value: Any) -> str | None:
    if not re.fullmatch(r"[0-9]{2}", value):
        return f"must be exactly two digits, got {value!r}"
    return None


OBSERVE = "observe"
ENFORCE = "enforce"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    mode: str = setting(
        OBSERVE,
        "observe: the agent decides and audits everything but writes nothing beyond the "
        "settings of its container-creation answers (no cgroup, procfs or resctrl schemata "
        "writes to running containers, every mitigation rung and the eviction manager in "
        "dry-run, no taint, no node condition); enforce: it acts, each rung and the eviction "
        "manager keeping their own dry_run. Observe is the default so that an install shows "
        "what it would do before it does it.",
        choices=(OBSERVE, ENFORCE),
    )
    scheduling: str = setting(
        NORMAL,
        "The kernel's CPU scheduling policy of every thread of the agent. normal (SCHED_OTHER): "
        "the kernel's default, a waking thread preempts the task running on its CPU at once; "
        "batch (SCHED_BATCH): the agent keeps its CPU share but a thread that wakes never "
        "preempts (it runs at the next scheduler tick, a few milliseconds later at most). Not "
        "the default: in a cgroup v2 guest it did not lower an online service's tail, and the "
        "service stopped answering for 300 ms or more beside it more often than beside any "
        "other mode (docs/operations.md). Read at start.",
        choices=(NORMAL, BATCH),
    )


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
        "On invalid input, a failed capability or a missed deadline, answer with an error status "
        "(fails the pod or container) instead of a partial adjustment.",
    )
    register_timeout_ms: int = setting(
        5000,
        "Budget for the RegisterPlugin call, and for each later step of the handshake (and the "
        "rest of a frame that has begun) until Configure states the runtime's own registration "
        "timeout.",
        unit="milliseconds", minimum=100, maximum=60_000,
    )
    max_sync_pods: int = setting(
        4096,
        "Pods one Synchronize may list, all chunks together. Over it the Synchronize is refused "
        "(an audit record says why) and the agent goes on with the pods it knows. The node "
        "state keeps 4096 pods at most; Kubernetes runs 110 per node by default.",
        minimum=1, maximum=4096,
    )
    max_sync_containers: int = setting(
        16384,
        "Containers one Synchronize may list, all chunks together (refused over it, like "
        "max_sync_pods). The node state keeps 16384 containers at most.",
        minimum=1, maximum=16384,
    )
    max_sync_bytes: int = setting(
        64 << 20,
        "Bytes of one Synchronize on the wire, all chunks together (refused over it, like "
        "max_sync_pods). Chunks are converted as they arrive and not kept, so this bounds the "
        "work, not the memory: a node of 500 pods sends about 10 MiB.",
        unit="bytes", minimum=4 << 20, maximum=1 << 30,
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
class MetricsConfig:
    enabled: bool = setting(
        False, "Serve Prometheus metrics (/metrics) and health checks (/healthz, /readyz) over "
        "HTTP. Read at start."
    )
    address: str = setting("127.0.0.1", "Listen address of the metrics endpoint.")
    port: int = setting(9464, "Listen port of the metrics endpoint.", minimum=1, maximum=65535)


def _socket_path(value: Any) -> str | None:
    if not value.startswith("/"):
        return f"must be an absolute path, got {value!r}"
    # sun_path holds 108 bytes with the terminating NUL.
    if len(value.encode()) > 107:
        return f"must be at most 107 bytes long (a unix socket path), got {len(value.encode())}"
    return None


@dataclass(frozen=True, slots=True)
class StatusConfig:
    enabled: bool = setting(
        True, "Answer `nri-qos status` on a local unix socket (root only). Read at start."
    )
    socket: str = setting(
        "/run/nri-qos/status.sock",
        "Path of the status socket (mode 0600); its directory is created with mode 0700.",
        check=_socket_path,
    )


@dataclass(frozen=True, slots=True)
class Config:
    agent: AgentConfig = section(
        AgentConfig, "The agent as a whole: observe or enforce, and how its threads are scheduled.")
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
    cpu_idle: CpuIdleConfig = section(
        CpuIdleConfig, "Idle CPU priority for the reclaimed tier (off by default).")
    numa: NumaConfig = section(NumaConfig, "NUMA binding of reclaimed pods.")
    numa_balance: NumaBalanceConfig = section(
        NumaBalanceConfig, "Moving reclaimed pods' memory off a NUMA node under its watermark.")
    offload: OffloadConfig = section(
        OffloadConfig, "Offloading: proactive reclaim of offline containers' cold memory."
    )
    detection: DetectionConfig = section(DetectionConfig, "Memory interference detection.")
    mitigation: MitigationConfig = section(MitigationConfig, "Mitigation ladder.")
    eviction: EvictionConfig = section(EvictionConfig, "Eviction through the Kubernetes API.")
    kubernetes: KubernetesConfig = section(KubernetesConfig, "Kubernetes API access.")
    logging: LoggingConfig = section(LoggingConfig, "Operational log and audit trail.")
    metrics: MetricsConfig = section(MetricsConfig, "Prometheus metrics.")
    status: StatusConfig = section(StatusConfig, "The local socket `nri-qos status` reads.")

    def read_keys(self) -> ReadKeys:
        """The pod annotations and labels some policy reads with this configuration."""
        return ReadKeys(frozenset({
            self.qos.annotation, KATALYST_ANNOTATION, KOORDINATOR_KEY, VOLCANO_QOS_ANNOTATION,
            VOLCANO_COLOCATION_ANNOTATION, self.resctrl.annotation, KOORDINATOR_ANNOTATION,
            self.oom.annotation, self.detection.rss_overuse_annotation, *EVICTION_ANNOTATIONS,
            self.offload.annotation,
        }), labels=frozenset({KOORDINATOR_KEY,
                              *label_keys(self.eviction.exclude_selectors)}))

    def validate(self) -> list[tuple[str, str]]:
        """Hook executables named anywhere in the configuration must be trusted files."""
        return [(key, problem) for key, path in self._hook_paths()
                if (problem := check_hook_path(path)) is not None]

    def _hook_paths(self) -> Iterator[tuple[str, str]]:
        monitor = self.resctrl.monitor_hook
        if monitor.enabled:
            yield "resctrl.monitor_hook.path", monitor.path
        for level, hooks in self.oci_hooks.levels.items():
            for stage in HookStage:
                entries: tuple[OciHook, ...] = getattr(hooks, stage.value)
                for i, hook in enumerate(entries):
                    yield f"oci_hooks.levels.{level}.{stage.value}[{i}].path", hook.path



def in_force(cfg: Config) -> Config:
    """What the agent runs with: in observe mode every action that reaches beyond the creation
    answers is held in dry-run, whatever its own setting says, so that one key decides whether a
    node is acted on."""
    if cfg.agent.mode != OBSERVE:
        return cfg
    rungs = cfg.mitigation
    mitigation = dataclasses.replace(
        rungs,
        taint=dataclasses.replace(rungs.taint, dry_run=True),
        tune=dataclasses.replace(rungs.tune, dry_run=True),
        drop_cache=dataclasses.replace(rungs.drop_cache, dry_run=True),
        evict=dataclasses.replace(rungs.evict, dry_run=True),
    )
    return dataclasses.replace(cfg, mitigation=mitigation,
                               eviction=dataclasses.replace(cfg.eviction, dry_run=True))
