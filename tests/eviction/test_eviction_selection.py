"""The eviction manager's choice of pods: selectors, the filter and its refusals, the ranking."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from common.podmeta import OwnerRef
from reconciler.eviction.api import ActivePod
from reconciler.eviction.choice import PodFacts, PodFilter, rank
from reconciler.eviction.config import SYSTEM_CLUSTER_CRITICAL, SYSTEM_NODE_CRITICAL, EvictionConfig
from reconciler.eviction.selector import SelectorError, parse_selector
from tests.support.eviction_pods import GIB, pod

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
