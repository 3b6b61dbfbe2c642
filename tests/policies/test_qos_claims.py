"""A pod cannot choose its own privilege: the level it claims is bounded by its Kubernetes QoS
class, system_cores by its namespace; a refused claim gives what the pod would get without it,
with the claim, where it was written and why."""

from __future__ import annotations

import dataclasses

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.metrics import Metrics
from common.state import report_refusals
from hooks.config_fields import frozen_map
from hooks.model import PodInfo
from hooks.qos_level import LevelDecision, QosConfig, Refusal, resolve_level
from tests.support.qos_claims import CASES, CLASS_DEFAULT, CLASSES, KATALYST, OURS, Claim

UID = "0f6a3c1e-2b7d-4e59-9a61-5d0c8b1f2e34"
PARENTS = {"besteffort": f"/kubepods/besteffort/pod{UID}",
           "burstable": f"/kubepods/burstable/pod{UID}",
           "guaranteed": f"/kubepods/pod{UID}"}
CFG = QosConfig()


def claimant(case: Claim) -> PodInfo:
    written = frozen_map({case.key: case.value})
    return PodInfo(id="s1", uid=UID, name="p", namespace=case.namespace,
                   annotations=written if case.kind == "annotation" else frozen_map({}),
                   labels=written if case.kind == "label" else frozen_map({}),
                   cgroup_parent=PARENTS[CLASSES[case.qos_class]])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_claim_is_bounded_by_the_class_and_the_namespace(case: Claim) -> None:
    decision = resolve_level(claimant(case), CFG)
    if case.allowed:
        assert decision.level == case.level
        assert decision.refused is None
    else:
        assert decision.level == CLASS_DEFAULT[case.qos_class]
        assert decision.source == "kubernetes_qos"
        assert decision.refused is not None
        assert decision.refused.claim == case.level
        assert decision.refused.key == f"{case.kind} {case.key}"


def test_besteffort_claiming_system_cores_in_an_ordinary_namespace_is_refused() -> None:
    pod = PodInfo(id="s1", uid=UID, name="p", namespace="batch",
                  annotations=frozen_map({OURS: "system_cores"}),
                  cgroup_parent=PARENTS["besteffort"])
    assert resolve_level(pod, CFG) == LevelDecision(
        "reclaimed_cores", "kubernetes_qos", (),
        Refusal("system_cores", "annotation", f"annotation {OURS}",
                "system_cores only for namespaces kube-system"))


@pytest.mark.parametrize(("qos_class", "claim", "ceiling"), [
    ("besteffort", "shared_cores", "reclaimed_cores"),
    ("burstable", "dedicated_cores", "shared_cores"),
])
def test_the_refusal_names_the_class_ceiling(qos_class: str, claim: str, ceiling: str) -> None:
    pod = PodInfo(id="s1", uid=UID, name="p", namespace="batch",
                  annotations=frozen_map({KATALYST: claim}), cgroup_parent=PARENTS[qos_class])
    refused = resolve_level(pod, CFG).refused
    assert refused is not None
    assert refused.reason == \
        f"above what the pod's QoS class {qos_class} allows ({ceiling} at most)"


def test_guaranteed_may_claim_dedicated_cores_exactly() -> None:
    pod = PodInfo(id="s1", uid=UID, name="p", namespace="batch",
                  annotations=frozen_map({KATALYST: "dedicated_cores"}),
                  cgroup_parent=PARENTS["guaranteed"])
    assert resolve_level(pod, CFG) == LevelDecision("dedicated_cores", "katalyst", ())


def test_namespaces_are_configured_per_level() -> None:
    cfg = dataclasses.replace(CFG, level_namespaces=frozen_map(
        {"system_cores": ("infra",), "dedicated_cores": ("trading",)}))
    def level(namespace: str, claim: str) -> str:
        pod = PodInfo(id="s1", uid=UID, name="p", namespace=namespace,
                      annotations=frozen_map({OURS: claim}), cgroup_parent=PARENTS["guaranteed"])
        return resolve_level(pod, cfg).level
    assert level("infra", "system_cores") == "system_cores"
    assert level("kube-system", "system_cores") == "shared_cores"
    assert level("trading", "dedicated_cores") == "dedicated_cores"
    assert level("batch", "dedicated_cores") == "shared_cores"
    # An empty list: no pod may claim the level.
    nobody = dataclasses.replace(CFG, level_namespaces=frozen_map({"system_cores": ()}))
    pod = PodInfo(id="s1", uid=UID, name="p", namespace="kube-system",
                  annotations=frozen_map({OURS: "system_cores"}))
    refused = resolve_level(pod, nobody).refused
    assert refused is not None
    assert refused.reason == "system_cores only for namespaces (none)"
    # Not listed at all: no class grants it either.
    unlisted = dataclasses.replace(CFG, level_namespaces=frozen_map({}))
    refused = resolve_level(pod, unlisted).refused
    assert refused is not None
    assert refused.reason == "system_cores only for the namespaces listed for it (none)"
    assert resolve_level(dataclasses.replace(pod, annotations=frozen_map(
        {OURS: "dedicated_cores"})), unlisted).level == "dedicated_cores"


def test_a_refused_claim_ends_the_search() -> None:
    # A later source that would be allowed does not stand in for the refused one.
    pod = PodInfo(id="s1", uid=UID, name="p", namespace="batch",
                  annotations=frozen_map({OURS: "dedicated_cores", KATALYST: "reclaimed_cores"}),
                  cgroup_parent=PARENTS["burstable"])
    decision = resolve_level(pod, CFG)
    assert (decision.level, decision.source) == ("shared_cores", "kubernetes_qos")


# Without the kubernetes_qos source a pod's class decides nothing: unclaimed, it gets the default.
ANNOTATION_ONLY = dataclasses.replace(
    CFG, sources=("annotation",), default_level="reclaimed_cores",
    level_namespaces=frozen_map({"shared_cores": ("web",), "system_cores": ("kube-system",)}))


@pytest.mark.parametrize("qos_class", sorted(PARENTS))
@pytest.mark.parametrize("claim", ["shared_cores", "system_cores"])
def test_a_refused_claim_gets_what_the_pod_gets_without_any_claim(qos_class: str,
                                                                  claim: str) -> None:
    plain = PodInfo(id="s1", uid=UID, name="p", namespace="batch",
                    cgroup_parent=PARENTS[qos_class])
    claiming = dataclasses.replace(plain, annotations=frozen_map({OURS: claim}))
    decision = resolve_level(claiming, ANNOTATION_ONLY)
    assert decision.refused is not None
    assert (decision.level, decision.source) == ("reclaimed_cores", "default")
    assert resolve_level(plain, ANNOTATION_ONLY) == LevelDecision("reclaimed_cores", "default")


def test_a_refused_claim_without_the_class_source_stays_under_the_ceiling() -> None:
    generous = dataclasses.replace(ANNOTATION_ONLY, default_level="dedicated_cores")
    pod = PodInfo(id="s1", uid=UID, name="p", namespace="batch",
                  annotations=frozen_map({OURS: "system_cores"}),
                  cgroup_parent=PARENTS["guaranteed"])
    assert resolve_level(pod, generous).level == "dedicated_cores"
    assert resolve_level(pod, generous, ceiling="shared_cores").level == "shared_cores"


def test_a_pod_without_a_kubelet_cgroup_parent_is_bounded_by_the_namespace_only() -> None:
    def level(claim: str, namespace: str = "batch") -> str:
        pod = PodInfo(id="s1", uid=UID, name="p", namespace=namespace,
                      annotations=frozen_map({OURS: claim}))
        return resolve_level(pod, CFG).level
    assert level("dedicated_cores") == "dedicated_cores"
    assert level("system_cores") == "shared_cores"
    assert level("system_cores", "kube-system") == "system_cores"


def test_the_ceiling_bounds_claims_but_not_the_class_level() -> None:
    guaranteed = PodInfo(id="s1", uid=UID, name="p", namespace="batch",
                         annotations=frozen_map({KATALYST: "dedicated_cores"}),
                         cgroup_parent=PARENTS["guaranteed"])
    decision = resolve_level(guaranteed, CFG, ceiling="reclaimed_cores")
    assert decision.level == "reclaimed_cores"
    assert decision.refused == Refusal(
        "dedicated_cores", "katalyst", f"annotation {KATALYST}",
        "above the level the pod had at creation (reclaimed_cores)")
    # At the ceiling exactly the claim stands.
    assert resolve_level(guaranteed, CFG, ceiling="dedicated_cores").refused is None
    # Without a claim the class decides, whatever the ceiling.
    plain = dataclasses.replace(guaranteed, annotations=frozen_map({}))
    assert resolve_level(plain, CFG, ceiling="reclaimed_cores").level == "shared_cores"


def test_a_refusal_is_one_audit_record_and_a_count() -> None:
    sink = MemoryAuditSink()
    metrics = Metrics()
    report = report_refusals(AuditLog(sink), metrics)
    pod = PodInfo(id="s1", uid=UID, name="p", namespace="batch",
                  annotations=frozen_map({OURS: "system_cores"}),
                  cgroup_parent=PARENTS["besteffort"])
    refusal = resolve_level(pod, CFG).refused
    assert refusal is not None
    report(pod, refusal)
    assert sink.named("qos_level_refused") == [{
        "pod_uid": UID, "pod": "batch/p", "claim": "system_cores",
        "source": f"annotation {OURS}",
        "reason": "system_cores only for namespaces kube-system"}]
    assert metrics.registry.get_sample_value(
        "nri_qos_qos_level_refused_total", {"source": "annotation"}) == 1.0
