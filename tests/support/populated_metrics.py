"""The agent's metrics registry with every series given a value, for the tests that compare
what the docs and the monitoring manifests name with what the agent exports."""

from __future__ import annotations

from dataclasses import dataclass

import prometheus_client

from common.metrics import Metrics, PluginMetrics
from reconciler.detection.signals import NODE, Board, Level, Reading
from reconciler.metrics import ReconcilerMetrics


@dataclass(frozen=True)
class Usage:
    """One resctrl group's monitoring reading."""

    group: str = "nriqos-reclaimed_cores"
    kind: str = "class"
    domain: str = "00"
    llc_occupancy_bytes: int | None = 1
    mbm_total_bytes: int | None = 2
    mbm_local_bytes: int | None = 3
    pod_uid: str | None = None


@dataclass(frozen=True)
class Offloaded:
    """One offloading pod's figures."""

    pod_uid: str = "uid-1"
    offloaded_bytes: int = 4096
    stall_us: int = 10
    refaults_per_s: float = 0.5


def populated_registry() -> prometheus_client.CollectorRegistry:
    """The registry as the agent assembles it, every series given a value."""
    metrics = Metrics("1.0")
    plugin, reconciler = PluginMetrics(metrics.registry), ReconcilerMetrics(metrics.registry)
    plugin.nri_request("create_container", "ok", 0.001)
    plugin.nri_adjusted(["rdt_class"])
    plugin.nri_connection("synchronized", 1.0)
    plugin.nri_reconnected()
    plugin.nri_runtime("containerd", "v2.0.0", "v0.9.0")
    plugin.watch_rejections(lambda: {"bad_payload": 1})
    metrics.config_reload(True, 1.0)
    metrics.config_reload(False, 1.0)
    metrics.qos_level_refused("annotation")
    metrics.host_write("/sys/fs/cgroup/x/memory.high", "written")
    metrics.watch_node(lambda: (1, 1))
    reconciler.loop_cycle("drift", 0.01, failed=True)
    reconciler.memory_guard(1 << 30, 1 << 29)
    reconciler.ladder_level(1)
    reconciler.drop_cache("done", 4096)
    reconciler.squeeze_judged(True)
    reconciler.numa_balance_step("done", 4096, 0.1)
    reconciler.eviction("system_pressure", "evicted")
    reconciler.taint("nri-qos.io/memory-pressure", True)
    board = Board()
    board.publish("psi", [Reading("psi", NODE, Level.LOW, 1.0, 1.0, "percent")])
    reconciler.watch_board(board)
    reconciler.watch_resctrl(lambda: [Usage()])
    reconciler.watch_offload(lambda: [Offloaded()])
    return metrics.registry
