"""The eviction manager's pure parts: selectors, the filter, the ranking, the token bucket, the
smoothing of thresholds and conditions, the configuration, and the in-tree plugins over a board."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from common.podmeta import OwnerRef
from nri_plugin.config.loader import ConfigError, parse_toml
from nri_plugin.config.schema import Config
from reconciler.detection.signals import Board, Level, Reading
from reconciler.eviction.api import ActivePod, Condition, MetType, Operator
from reconciler.eviction.builtin import in_tree_plugins
from reconciler.eviction.choice import PodFacts, PodFilter, rank
from reconciler.eviction.config import SYSTEM_CLUSTER_CRITICAL, SYSTEM_NODE_CRITICAL, EvictionConfig
from reconciler.eviction.ratelimit import TokenBucket
from reconciler.eviction.selector import SelectorError, parse_selector
from reconciler.eviction.smoothing import ConditionTracker, MetSmoother

GIB = 1 << 30


def pod(uid: str = "u", *, level: str = "reclaimed_cores", priority: int | None = 0,
        usage: int | None = GIB, namespace: str = "batch", request: int | None = GIB,
        ) -> ActivePod:
    return ActivePod(uid, namespace, f"pod-{uid}", level, priority, request, usage)


DAEMONSET = OwnerRef("apps/v1", "DaemonSet", "agent", "uid-ds")


def facts(active: ActivePod | None = None, *, labels: dict[str, str] | None = None,
          annotations: dict[str, str] | None = None, owner: str | None = "ReplicaSet",
          terminating: bool = False, described: bool = True,
          daemonset: bool | None = False) -> PodFacts:
    claimed = DAEMONSET if owner == "DaemonSet" else None
    return PodFacts(active or pod(), MappingProxyType(labels or {}),
                    MappingProxyType(annotations or {}), terminating, described,
                    claimed_daemonset=claimed, daemonset=daemonset if claimed else False)


# ---- selectors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "labels", "matches"), [
    ("app=db", {"app": "db"}, True),
    ("app==db", {"app": "db"}, True),
    ("app=db", {"app": "web"}, False),
    ("app!=db", {"app": "web"}, True),
    ("app!=db", {}, True),  # as in Kubernetes: no key, not equal
    ("app", {"app": ""}, True),
    ("app", {}, False),
    ("!app", {}, True),
    ("!app", {"app": "x"}, False),
    ("tier in (db, cache)", {"tier": "cache"}, True),
    ("tier in (db,cache)", {"tier": "web"}, False),
    ("tier in (db)", {}, False),
    ("tier notin (db,cache)", {"tier": "web"}, True),
    ("tier notin (db,cache)", {}, True),
    ("tier notin (db,cache)", {"tier": "db"}, False),
    ("example.com/keep=true,tier in (db,cache)", {"example.com/keep": "true", "tier": "db"},
     True),
    ("example.com/keep=true,tier in (db,cache)", {"example.com/keep": "true"}, False),
])
def test_selector_matching(text: str, labels: dict[str, str], matches: bool) -> None:
    assert parse_selector(text).matches(labels) is matches


@pytest.mark.parametrize("text", ["", "  ", "app=db,", "a b", "tier in ()", "tier in (a",
                                  "tier in a)", "-bad=x", "app=in valid", "Bad_Prefix/x=y"])
def test_selector_errors(text: str) -> None:
    with pytest.raises(SelectorError):
        parse_selector(text)


# ---- the filter ---------------------------------------------------------------------------------

FILTER = PodFilter(EvictionConfig(exclude_namespaces=("kube-system", "infra"),
                                  exclude_selectors=("nri-qos.io/evict=never", "!evictable"),
                                  exclude_selector_namespaces=("batch",)))
EVICTABLE = {"evictable": "yes"}


def why(item: PodFacts, *, need_description: bool = True) -> str | None:
    return FILTER.why_not(item, need_description=need_description)


def test_an_ordinary_offline_pod_passes() -> None:
    assert why(facts(labels=EVICTABLE)) is None


def test_labels_spare_a_pod_only_in_the_namespaces_trusted_with_selectors() -> None:
    never = {**EVICTABLE, "nri-qos.io/evict": "never"}
    assert why(facts(labels=never)) == "labels match excluded selector 'nri-qos.io/evict=never'"
    # The same label written by the author of a pod elsewhere spares nothing.
    assert why(facts(pod(namespace="tenant-a"), labels=never)) is None
    assert why(facts(pod(namespace="tenant-a"), labels={})) is None


def test_a_daemonset_the_api_does_not_have_protects_nothing() -> None:
    assert why(facts(labels=EVICTABLE, owner="DaemonSet", daemonset=False)) is None


@pytest.mark.parametrize(("item", "reason"), [
    (facts(pod(level="system_cores"), labels=EVICTABLE), "system_cores pod"),
    (facts(labels=EVICTABLE, annotations={"kubernetes.io/config.mirror": "abc"}),
     "static or mirror pod"),
    (facts(labels=EVICTABLE, annotations={"kubernetes.io/config.source": "file"}),
     "static or mirror pod"),
    (facts(labels=EVICTABLE, annotations={"kubernetes.io/config.source": "http"}),
     "static or mirror pod"),
    (facts(labels=EVICTABLE, terminating=True), "terminating"),
    (facts(labels=EVICTABLE, described=False),
     "not described by the API yet (owner and priority unknown)"),
    (facts(labels=EVICTABLE, owner="DaemonSet", daemonset=True), "owned by a DaemonSet"),
    (facts(labels=EVICTABLE, owner="DaemonSet", daemonset=None),
     "DaemonSet owner not confirmed by the API yet"),
    (facts(pod(priority=SYSTEM_NODE_CRITICAL), labels=EVICTABLE),
     f"priority {SYSTEM_NODE_CRITICAL} >= {SYSTEM_CLUSTER_CRITICAL}"),
    (facts(pod(priority=SYSTEM_CLUSTER_CRITICAL), labels=EVICTABLE),
     f"priority {SYSTEM_CLUSTER_CRITICAL} >= {SYSTEM_CLUSTER_CRITICAL}"),
    (facts(pod(namespace="infra"), labels=EVICTABLE), "namespace infra excluded"),
    (facts(labels={**EVICTABLE, "nri-qos.io/evict": "never"}),
     "labels match excluded selector 'nri-qos.io/evict=never'"),
    (facts(), "labels match excluded selector '!evictable'"),
])
def test_each_refusal(item: PodFacts, reason: str) -> None:
    assert why(item) == reason


def test_filter_boundaries() -> None:
    assert why(facts(pod(priority=SYSTEM_CLUSTER_CRITICAL - 1), labels=EVICTABLE)) is None
    assert why(facts(pod(priority=None), labels=EVICTABLE)) is None
    assert why(facts(labels=EVICTABLE, annotations={"kubernetes.io/config.source": "api"})) \
        is None
    # Without API access nothing is described, and the pod is judged on what NRI knows.
    assert why(facts(labels=EVICTABLE, described=False), need_description=False) is None


# ---- ranking ------------------------------------------------------------------------------------


def ranked(pods: list[ActivePod], keys: tuple[str, ...]) -> list[str]:
    return [p.uid for p in rank(pods, lambda p: p, keys)]


def test_rank_by_level_offline_first() -> None:
    pods = [pod("d", level="dedicated_cores"), pod("s", level="shared_cores"),
            pod("r", level="reclaimed_cores")]
    assert ranked(pods, ("qos_level",)) == ["r", "s", "d"]


def test_rank_by_priority_lowest_first() -> None:
    pods = [pod("high", priority=1000), pod("none", priority=None), pod("neg", priority=-5)]
    assert ranked(pods, ("priority",)) == ["neg", "none", "high"]


def test_rank_by_usage_largest_first() -> None:
    pods = [pod("small", usage=GIB), pod("unknown", usage=None), pod("big", usage=3 * GIB)]
    assert ranked(pods, ("memory_usage",)) == ["big", "small", "unknown"]


def test_rank_keys_in_order_and_stable_ties() -> None:
    pods = [pod("s-big", level="shared_cores", usage=8 * GIB),
            pod("r-p10", priority=10, usage=4 * GIB),
            pod("r-p0-small", priority=0, usage=GIB),
            pod("r-p0-big", priority=0, usage=2 * GIB),
            pod("tie-a", priority=0, usage=2 * GIB),
            pod("tie-b", priority=0, usage=2 * GIB)]
    default = EvictionConfig().sort_keys
    assert default == ("qos_level", "priority", "memory_usage")
    assert ranked(pods, default) == ["r-p0-big", "tie-a", "tie-b", "r-p0-small", "r-p10",
                                     "s-big"]
    assert ranked(pods, ("memory_usage", "qos_level", "priority")) == [
        "s-big", "r-p10", "r-p0-big", "tie-a", "tie-b", "r-p0-small"]
    # No keys at all: the plugins' order.
    assert ranked(list(reversed(pods)), ()) == [p.uid for p in reversed(pods)]


# ---- the token bucket ---------------------------------------------------------------------------


def test_bucket_burst_then_one_per_interval_at_exact_boundaries() -> None:
    bucket = TokenBucket(3, 10.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.wait(0.0) == 10.0
    assert not bucket.take(9.999)
    assert bucket.wait(9.5) == 0.5
    assert bucket.take(10.0)
    assert not bucket.take(10.0)
    assert not bucket.take(19.999)
    assert bucket.take(20.0)
    # Idle for long: never more than the burst.
    assert bucket.available(1000.0) == 3
    assert [bucket.take(1000.0) for _ in range(4)] == [True, True, True, False]


def test_bucket_refill_counts_from_the_first_token_taken() -> None:
    bucket = TokenBucket(2, 10.0, now=0.0)
    assert bucket.take(5.0)  # full until now: the refill interval starts here
    assert bucket.take(6.0)
    assert not bucket.take(14.999)
    assert bucket.take(15.0)  # 10 s after the first token left
    assert bucket.available(24.999) == 0
    assert bucket.available(25.0) == 1
    assert bucket.available(35.0) == 2


def test_bucket_give_back_and_reconfigure() -> None:
    bucket = TokenBucket(3, 10.0, now=0.0)
    assert bucket.take(0.0)
    bucket.give_back(0.0)
    assert bucket.available(0.0) == 3
    bucket.give_back(0.0)
    assert bucket.available(0.0) == 3  # never above the burst
    bucket.configure(1, 10.0, 0.0)
    assert [bucket.take(0.0) for _ in range(2)] == [True, False]
    bucket.configure(1, 2.0, 0.0)
    assert bucket.take(2.0)
    with pytest.raises(ValueError, match="burst"):
        TokenBucket(0, 1.0, 0.0)


def test_bucket_wait_is_zero_while_a_token_is_there() -> None:
    bucket = TokenBucket(2, 10.0, now=0.0)
    assert bucket.wait(0.0) == 0.0
    assert bucket.take(0.0)
    assert bucket.wait(0.0) == 0.0  # one left
    assert bucket.take(0.0)
    assert bucket.wait(0.0) == 10.0
    assert bucket.wait(10.0) == 0.0


def test_bucket_give_back_from_two_below_the_burst_keeps_the_refill() -> None:
    bucket = TokenBucket(3, 10.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [True, True, True]
    bucket.give_back(1.0)
    assert bucket.available(1.0) == 1
    # The refill under way since 0 still ends at 10, not 11.
    assert bucket.available(9.999) == 1
    assert bucket.available(10.0) == 2
    bucket.give_back(10.0)
    assert bucket.available(10.0) == 3
    bucket.give_back(10.0)
    assert bucket.available(10.0) == 3


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan")])
def test_bucket_refuses_an_interval_that_is_not_positive(interval: float) -> None:
    with pytest.raises(ValueError, match="interval > 0"):
        TokenBucket(1, interval, 0.0)
    bucket = TokenBucket(2, 10.0, 0.0)
    assert bucket.take(0.0)
    with pytest.raises(ValueError, match="interval > 0"):
        bucket.configure(2, interval, 1.0)
    # Unchanged, and refilling as before.
    assert bucket.available(9.999) == 1
    assert bucket.available(10.0) == 2
    with pytest.raises(ValueError, match="burst >= 1"):
        bucket.configure(0, 10.0, 1.0)


def test_bucket_reload_in_the_middle_of_a_refill_counts_the_time_waited() -> None:
    bucket = TokenBucket(2, 10.0, now=0.0)
    assert bucket.take(0.0)
    assert bucket.take(0.0)
    bucket.configure(2, 20.0, 5.0)  # 5 s into a 10 s refill; the interval is now 20 s
    assert bucket.available(19.999) == 0
    assert bucket.available(20.0) == 1
    assert bucket.wait(20.0) == 0.0
    assert bucket.take(20.0)
    assert bucket.wait(20.0) == 20.0
    # A shorter interval: a token the old one had not given yet comes at once.
    bucket.configure(2, 5.0, 26.0)
    assert bucket.available(26.0) == 1


def test_bucket_clock_going_backwards_mints_nothing() -> None:
    bucket = TokenBucket(2, 10.0, now=100.0)
    assert bucket.take(100.0)
    assert bucket.take(100.0)
    assert bucket.available(50.0) == 0
    assert bucket.wait(50.0) == 10.0  # never more than one interval
    assert bucket.available(59.999) == 0
    assert bucket.available(60.0) == 1
    # Back again: the token it has, no more.
    assert bucket.take(40.0)
    assert not bucket.take(40.0)
    assert bucket.available(49.999) == 0
    assert bucket.available(50.0) == 1


# ---- smoothing ----------------------------------------------------------------------------------


def test_a_condition_met_at_its_first_observation_stays_true_for_the_transition() -> None:
    tracker = ConditionTracker()
    assert tracker.observe("C", True, 0.0, 300.0) is True
    assert tracker.observe("C", False, 1.0, 300.0) is True
    assert tracker.observe("C", False, 299.999, 300.0) is True
    assert tracker.observe("C", False, 300.0, 300.0) is False
    assert tracker.status("C") is False
    # Never met: false from the first observation.
    assert tracker.observe("D", False, 0.0, 300.0) is False


def test_hard_met_counts_after_a_streak() -> None:
    met = MetSmoother()
    hard = MetType.HARD_MET
    assert met.observe("p", hard, 3) is MetType.SOFT_MET
    assert met.observe("p", hard, 3) is MetType.SOFT_MET
    assert met.observe("p", hard, 3) is hard
    assert met.observe("p", hard, 3) is hard
    assert met.observe("p", MetType.SOFT_MET, 3) is MetType.SOFT_MET  # breaks the streak
    assert met.observe("p", hard, 3) is MetType.SOFT_MET
    assert met.observe("p", hard, 3) is MetType.SOFT_MET
    assert met.observe("p", None, 3) is MetType.NOT_MET  # no answer breaks it too
    assert met.observe("p", hard, 1) is hard
    assert met.observe("other", hard, 2) is MetType.SOFT_MET  # per plugin
    met.keep_only(["p"])
    assert met.observe("other", hard, 2) is MetType.SOFT_MET
    assert met.observe("p", hard, 2) is hard  # a kept plugin's streak goes on


def test_condition_true_at_once_false_after_the_transition_period() -> None:
    tracker = ConditionTracker()
    assert tracker.observe("C", False, 0.0, 300.0) is False
    assert tracker.observe("C", True, 10.0, 300.0) is True
    assert tracker.observe("C", False, 11.0, 300.0) is True
    assert tracker.observe("C", False, 309.999, 300.0) is True
    assert tracker.observe("C", False, 310.0, 300.0) is False
    # Flapping keeps it true: every "met" restarts the period.
    for t in range(400, 1000, 100):
        assert tracker.observe("C", True, float(t), 300.0) is True
        assert tracker.observe("C", False, t + 50.0, 300.0) is True
    assert tracker.observe("C", False, 900.0 + 300.0, 300.0) is False
    assert tracker.status("C") is False
    assert tracker.status("unknown") is None
    assert tracker.names() == ["C"]


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


@pytest.fixture
def board() -> Board:
    return Board()


def plugins(board: Board, **changes: object) -> dict[str, object]:
    cfg = dataclasses.replace(EvictionConfig(), **changes)  # type: ignore[arg-type]
    return dict(in_tree_plugins(board, lambda: cfg))


ACTIVE = [pod("r-small", usage=GIB), pod("shared", level="shared_cores", usage=9 * GIB),
          pod("r-big", usage=4 * GIB), pod("r-unknown", usage=None)]


async def test_system_pressure_levels(board: Board) -> None:
    system = in_tree_plugins(board, EvictionConfig)["system_pressure"]
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
    narrow = in_tree_plugins(board, lambda: EvictionConfig(system_detectors=("kswapd",)))
    assert (await narrow["system_pressure"].threshold_met()).met is MetType.NOT_MET


async def test_pressure_levels_follow_the_config(board: Board) -> None:
    board.publish("system_free", [reading("system_free", "node", Level.LOW)])
    low = in_tree_plugins(board, lambda: EvictionConfig(soft_level="low", hard_level="low"))
    assert (await low["system_pressure"].threshold_met()).met is MetType.HARD_MET


async def test_top_pods_offline_largest_first(board: Board) -> None:
    system = in_tree_plugins(board, EvictionConfig)["system_pressure"]
    top = await system.get_top_eviction_pods(ACTIVE, 2, "node")
    assert top.uids == ("r-big", "r-small")
    assert top.grace_s == 1  # reclaimed_grace_period_s
    top = await system.get_top_eviction_pods(ACTIVE, 10, "node")
    assert top.uids == ("r-big", "r-small", "r-unknown")
    wide = in_tree_plugins(board, lambda: EvictionConfig(
        pressure_levels=("reclaimed_cores", "shared_cores")))
    top = await wide["numa_pressure"].get_top_eviction_pods(ACTIVE, 1, "numa:0")
    assert (top.uids, top.grace_s) == (("shared",), None)
    # The reclaimed tier's plugin only ever names reclaimed pods.
    top = await wide["reclaimed_pressure"].get_top_eviction_pods(ACTIVE, 1, "tier:reclaimed")
    assert top.uids == ("r-big",)
    assert (await system.get_evict_pods(ACTIVE)).pods == ()


async def test_numa_and_reclaimed_pressure(board: Board) -> None:
    found = in_tree_plugins(board, EvictionConfig)
    board.publish("numa_free", [reading("numa_free", "numa:0", Level.NONE),
                                reading("numa_free", "numa:1", Level.HIGH, 1, 5)])
    board.publish("fulfillment", [reading("fulfillment", "tier:reclaimed", Level.MEDIUM)])
    numa = await found["numa_pressure"].threshold_met()
    assert (numa.met, numa.scope, numa.condition) == (
        MetType.HARD_MET, "numa:1", Condition("NriQosNumaMemoryPressure", True))
    tier = await found["reclaimed_pressure"].threshold_met()
    assert (tier.met, tier.condition) == (
        MetType.SOFT_MET, Condition("NriQosReclaimedTierPressure", True))
    assert (await found["system_pressure"].threshold_met()).met is MetType.NOT_MET


async def test_rss_overuse_proposes_offline_pods_over_their_threshold(board: Board) -> None:
    rss = in_tree_plugins(board, EvictionConfig)["rss_overuse"]
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
        rss_overuse_levels=("reclaimed_cores", "shared_cores")))
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
