"""The eviction manager's configuration and its in-tree plugins over a board: system, NUMA and
reclaimed pressure, the largest offline pods, RSS overuse, and the probe."""

from __future__ import annotations

import dataclasses

import pytest

from nri_plugin.config.loader import ConfigError, parse_toml
from nri_plugin.config.schema import Config
from reconciler.detection.config import DetectionConfig
from reconciler.detection.counting import Counting
from reconciler.detection.detectors import RECLAIMED_TIER, fulfillment, rss_overuse
from reconciler.detection.signals import Board, Level, Reading
from reconciler.eviction.api import Condition, MetType, Operator
from reconciler.eviction.builtin import in_tree_plugins
from reconciler.eviction.config import SYSTEM_CLUSTER_CRITICAL, SYSTEM_NODE_CRITICAL, EvictionConfig
from tests.support.eviction_pods import GIB, pod

# ---- configuration ------------------------------------------------------------------------------


def test_defaults() -> None:
    cfg = EvictionConfig()
    assert cfg.dry_run is True
    assert (cfg.rate_burst, cfg.rate_interval_s, cfg.interval_s) == (3, 10.0, 1.0)
    assert cfg.priority_threshold == SYSTEM_CLUSTER_CRITICAL == 2_000_000_000
    assert SYSTEM_NODE_CRITICAL == 2_000_001_000
    assert cfg.plugin_dir == "/var/lib/nri-qos/eviction-plugins"


@pytest.mark.parametrize(("toml", "error"), [
    ('exclude_selectors = ["app in (a"]', "eviction.exclude_selectors: label selector"),
    ('exclude_selectors = [""]', "empty selector"),
    ('exclude_selectors = ["team=infra"]',
     "eviction.exclude_selectors: needs exclude_selector_namespaces"),
    ('exclude_selector_namespaces = ["Not_A_Namespace"]', "not a namespace name"),
    ('exclude_namespaces = ["Not_A_Namespace"]', "not a namespace name"),
    ('sort_keys = ["priority", "priority"]', "each key at most once"),
    ('sort_keys = ["age"]', "must be one of qos_level, priority, memory_usage"),
    ("grace_period_s = 0", "eviction.grace_period_s: 0 would delete the pod at once"),
    ("reclaimed_grace_period_s = 0", "eviction.reclaimed_grace_period_s: 0 would delete"),
    ("grace_period_s = -2", "eviction.grace_period_s: must be"),
    ("retry_initial_s = 10.0\nretry_max_s = 5.0", "eviction.retry_max_s: must be >= "),
    ('soft_level = "high"\nhard_level = "medium"', "eviction.soft_level: must not be above"),
    ('plugins = ["kubelet"]', "must be one of"),
    ("rate_burst = 0", "eviction.rate_burst: must be 1..100"),
    ('dry_run_plugins = ["a b"]', "not a plugin name"),
])
def test_config_errors(toml: str, error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_toml(Config, f"[eviction]\n{toml}\n")
    assert any(error in line for line in caught.value.errors), caught.value.errors


@pytest.mark.parametrize("toml", ["grace_period_s = 1", "grace_period_s = -1",
                                  "reclaimed_grace_period_s = 1"])
def test_grace_periods_from_one_second_or_the_pods_own(toml: str) -> None:
    parse_toml(Config, f"[eviction]\n{toml}\n")


def test_config_reads_the_static_pod_annotations() -> None:
    keys = Config().read_keys().annotations
    assert {"kubernetes.io/config.mirror", "kubernetes.io/config.source"} <= keys


# ---- in-tree plugins ----------------------------------------------------------------------------


def reading(detector: str, scope: str, level: Level, value: float = 1.0,
            threshold: float = 2.0, pod_uid: str | None = None) -> Reading:
    return Reading(detector, scope, level, value, threshold, "bytes", pod_uid=pod_uid)


def ALONE() -> Counting:
    """Node-wide readings count on their own (``mitigation.node_signals`` lets them drive)."""
    return Counting()


@pytest.fixture
def board() -> Board:
    return Board()


def plugins(board: Board, **changes: object) -> dict[str, object]:
    cfg = dataclasses.replace(EvictionConfig(), **changes)  # type: ignore[arg-type]
    return dict(in_tree_plugins(board, lambda: cfg, ALONE))


ACTIVE = [pod("r-small", usage=GIB), pod("shared", level="shared_cores", usage=9 * GIB),
          pod("r-big", usage=4 * GIB), pod("r-unknown", usage=None)]


async def test_system_pressure_levels(board: Board) -> None:
    system = in_tree_plugins(board, EvictionConfig, ALONE)["system_pressure"]
    answer = await system.threshold_met()
    assert answer.met is MetType.NOT_MET
    assert answer.condition == Condition("NriQosSystemMemoryPressure", False)
    board.publish("psi", [reading("psi", "node", Level.LOW, 12, 10)])
    board.publish("system_free", [reading("system_free", "node", Level.MEDIUM, 3, 4),
                                  reading("system_free", "numa:0", Level.HIGH)])
    board.publish("kswapd", [reading("kswapd", "node", Level.UNKNOWN)])
    answer = await system.threshold_met()
    assert answer.met is MetType.SOFT_MET
    assert (answer.observed, answer.threshold, answer.operator) == (3, 4, Operator.LESS_THAN)
    assert answer.condition == Condition("NriQosSystemMemoryPressure", True)
    assert answer.describe() == "system_free node: 3 bytes < 4 bytes"
    board.publish("psi", [reading("psi", "node", Level.HIGH, 40, 30)])
    answer = await system.threshold_met()
    assert (answer.met, answer.signal, answer.operator) == (
        MetType.HARD_MET, "psi", Operator.GREATER_THAN)
    # Only the configured detectors count.
    narrow = in_tree_plugins(board, lambda: EvictionConfig(system_detectors=("kswapd",)), ALONE)
    assert (await narrow["system_pressure"].threshold_met()).met is MetType.NOT_MET


async def test_pressure_levels_follow_the_config(board: Board) -> None:
    board.publish("system_free", [reading("system_free", "node", Level.LOW)])
    low = in_tree_plugins(board, lambda: EvictionConfig(soft_level="low", hard_level="low"),
                          ALONE)
    assert (await low["system_pressure"].threshold_met()).met is MetType.HARD_MET


async def test_top_pods_offline_largest_first(board: Board) -> None:
    system = in_tree_plugins(board, EvictionConfig, ALONE)["system_pressure"]
    top = await system.get_top_eviction_pods(ACTIVE, 2, "node")
    assert top.uids == ("r-big", "r-small")
    assert top.grace_s == 1  # reclaimed_grace_period_s
    top = await system.get_top_eviction_pods(ACTIVE, 10, "node")
    assert top.uids == ("r-big", "r-small", "r-unknown")
    wide = in_tree_plugins(board, lambda: EvictionConfig(
        pressure_levels=("reclaimed_cores", "shared_cores")), ALONE)
    top = await wide["numa_pressure"].get_top_eviction_pods(ACTIVE, 1, "numa:0")
    assert (top.uids, top.grace_s) == (("shared",), None)
    # The reclaimed tier's plugin only ever names reclaimed pods.
    top = await wide["reclaimed_pressure"].get_top_eviction_pods(ACTIVE, 1, RECLAIMED_TIER)
    assert top.uids == ("r-big",)
    assert (await system.get_evict_pods(ACTIVE)).pods == ()


async def test_numa_and_reclaimed_pressure(board: Board) -> None:
    found = in_tree_plugins(board, EvictionConfig, ALONE)
    board.publish("numa_free", [reading("numa_free", "numa:0", Level.NONE),
                                reading("numa_free", "numa:1", Level.HIGH, 1, 5)])
    board.publish("fulfillment", [reading("fulfillment", RECLAIMED_TIER, Level.MEDIUM)])
    numa = await found["numa_pressure"].threshold_met()
    assert (numa.met, numa.scope, numa.condition) == (
        MetType.HARD_MET, "numa:1", Condition("NriQosNumaMemoryPressure", True))
    tier = await found["reclaimed_pressure"].threshold_met()
    assert (tier.met, tier.condition) == (
        MetType.SOFT_MET, Condition("NriQosReclaimedTierPressure", True))
    assert (await found["system_pressure"].threshold_met()).met is MetType.NOT_MET


async def test_rss_overuse_proposes_offline_pods_over_their_threshold(board: Board) -> None:
    rss = in_tree_plugins(board, EvictionConfig, ALONE)["rss_overuse"]
    board.publish("rss_overuse", [
        reading("rss_overuse", "pod:r-big", Level.HIGH, 5 * GIB, 4 * GIB, "r-big"),
        reading("rss_overuse", "pod:shared", Level.HIGH, 9 * GIB, 2 * GIB, "shared"),
        reading("rss_overuse", "pod:r-small", Level.NONE, GIB, 2 * GIB, "r-small"),
        # Contradicts itself (a level but under the threshold): ignored.
        reading("rss_overuse", "pod:r-unknown", Level.HIGH, GIB, 2 * GIB, "r-unknown"),
        reading("rss_overuse", "pod:gone", Level.HIGH, 9 * GIB, GIB, "gone"),
    ])
    answer = await rss.get_evict_pods(ACTIVE)
    assert [(p.uid, p.force, p.grace_s) for p in answer.pods] == [("r-big", False, 1)]
    assert answer.pods[0].reason == (
        f"anonymous memory {5 * GIB} B over {4 * GIB} B (request x factor)")
    assert (await rss.threshold_met()).met is MetType.NOT_MET
    wide = in_tree_plugins(board, lambda: EvictionConfig(
        rss_overuse_levels=("reclaimed_cores", "shared_cores")), ALONE)
    answer = await wide["rss_overuse"].get_evict_pods(ACTIVE)
    assert [(p.uid, p.grace_s) for p in answer.pods] == [("r-big", 1), ("shared", None)]


# ---- nri-qos probe ------------------------------------------------------------------------------


def test_probe_reports_the_eviction_manager() -> None:
    from typing import cast

    from nri_plugin.report.features import FEATURES
    from reconciler.host.probe import HostInfo

    check = FEATURES["reconciler.eviction"]
    host = cast(HostInfo, None)  # the check reads only the configuration
    feature = check(Config(), host)
    assert feature.runs
    assert feature.detail.startswith("dry-run: decides and audits, writes nothing to the API")
    assert "/var/lib/nri-qos/eviction-plugins/*.sock" in feature.detail
    live = dataclasses.replace(Config(), eviction=EvictionConfig(
        dry_run=False, dry_run_plugins=("rss_overuse",)))
    assert check(live, host).detail.startswith(
        "evicts through the Eviction API (dry-run for rss_overuse)")
    off = dataclasses.replace(Config(), eviction=EvictionConfig(enabled=False))
    assert check(off, host) == type(feature)(False, "eviction manager is switched off in the "
                                                    "configuration")


@pytest.mark.parametrize(("name", "detector", "scope", "condition"), [
    ("system_pressure", "system_free", "node", "NriQosSystemMemoryPressure"),
    ("numa_pressure", "numa_free", "numa:1", "NriQosNumaMemoryPressure"),
])
async def test_where_online_pods_have_their_own_signals_node_readings_need_them(
        board: Board, name: str, detector: str, scope: str, condition: str) -> None:
    counted = [Counting(memcg=True, node=False)]
    plugin = in_tree_plugins(board, EvictionConfig, lambda: counted[0])[name]
    # page cache took the node's free memory: node-wide HIGH, no online pod feels anything
    board.publish(detector, [reading(detector, scope, Level.HIGH, 3, 4)])
    board.publish("psi", [reading("psi", "pod:web", Level.NONE, 0.0, 10.0, pod_uid="web"),
                          reading("psi", "node", Level.HIGH, 50.0, 30.0)])
    answer = await plugin.threshold_met()
    assert answer.met is MetType.NOT_MET
    assert answer.condition == Condition(condition, False)
    # an online pod stalls at medium: the lower of the two, soft-met
    board.publish("psi", [reading("psi", "pod:web", Level.MEDIUM, 31.0, 30.0, pod_uid="web")])
    assert (await plugin.threshold_met()).met is MetType.SOFT_MET
    # at high, hard-met, and the answer still names the node-wide reading
    board.publish("psi", [reading("psi", "pod:web", Level.HIGH, 60.0, 50.0, pod_uid="web")])
    answer = await plugin.threshold_met()
    assert (answer.met, answer.signal, answer.observed) == (MetType.HARD_MET, detector, 3)
    # the memcg pressure events (cgroup v1) count as the online pods' own signal too; an
    # unknown reading does not
    board.publish("psi", [reading("psi", "pod:web", Level.UNKNOWN, pod_uid="web")])
    assert (await plugin.threshold_met()).met is MetType.NOT_MET
    board.publish("pressure_level", [reading("pressure_level", "node", Level.HIGH, 1, 1)])
    assert (await plugin.threshold_met()).met is MetType.HARD_MET
    # but not where the online pods' refaults are read instead (cgroup v1): those count
    counted[0] = Counting(memcg=False, node=False)
    assert (await plugin.threshold_met()).met is MetType.NOT_MET
    board.publish("refault", [reading("refault", "pod:web", Level.MEDIUM, 6000, 5120,
                                      pod_uid="web")])
    assert (await plugin.threshold_met()).met is MetType.SOFT_MET
    # where node-wide readings drive on their own, they are enough
    board.publish("pressure_level", [])
    board.publish("refault", [])
    counted[0] = Counting(memcg=True, node=True)
    assert (await plugin.threshold_met()).met is MetType.HARD_MET


async def test_the_tier_plugin_never_waits_for_the_online_pods(board: Board) -> None:
    found = in_tree_plugins(board, EvictionConfig, lambda: Counting(memcg=True, node=False))
    board.publish("fulfillment",
                  [reading("fulfillment", RECLAIMED_TIER, Level.HIGH, 0.4, 0.5)])
    assert (await found["reclaimed_pressure"].threshold_met()).met is MetType.HARD_MET


async def test_the_tier_plugin_reads_the_fulfillment_detectors_own_reading(board: Board) -> None:
    """The reading as the fulfillment detector publishes it (its scope included) meets the
    plugin's threshold: the tier capped at 0.4 of its pods' requests is hard-met."""
    sample = fulfillment(str(4 * GIB), 10 * GIB, DetectionConfig(), at=1.0)
    assert sample is not None
    assert sample.level is Level.HIGH
    board.publish("fulfillment", [sample.reading(sample.level)])
    plugin = in_tree_plugins(board, EvictionConfig, ALONE)["reclaimed_pressure"]
    tier = await plugin.threshold_met()
    assert (tier.met, tier.condition) == (
        MetType.HARD_MET, Condition("NriQosReclaimedTierPressure", True))
    assert tier.scope == sample.scope


async def test_rss_overuse_spares_a_pod_over_its_request_but_within_the_factor(
        board: Board) -> None:
    """The detector's level low is the request itself; a pod is proposed only once its
    anonymous memory reaches request x factor (level high), as the detector grades it."""
    rss = in_tree_plugins(board, EvictionConfig, ALONE)["rss_overuse"]
    within = rss_overuse("r-big", f"total_rss {GIB + GIB // 50}\n", False, GIB, 1.05, 1.0)
    over = rss_overuse("r-small", f"total_rss {GIB + GIB // 10}\n", False, GIB, 1.05, 1.0)
    assert (within.level, over.level) == (Level.LOW, Level.HIGH)
    board.publish("rss_overuse", [within.reading(within.level), over.reading(over.level)])
    answer = await rss.get_evict_pods(ACTIVE)
    assert [p.uid for p in answer.pods] == ["r-small"]
    assert answer.pods[0].reason == (
        f"anonymous memory {GIB + GIB // 10} B over {int(GIB * 1.05)} B (request x factor)")
