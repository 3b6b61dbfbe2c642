"""A pod sandbox is converted and its level resolved once, not at every event."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nri_plugin.config.schema import QosConfig
from nri_plugin.convert import InvalidInput
from nri_plugin.pod_views import PodViews
from protos import nri_api_pb2 as api


def sandbox(pod_id: str, level: str = "reclaimed_cores") -> api.PodSandbox:
    pod = api.PodSandbox(id=pod_id, uid=f"uid-{pod_id}", name=pod_id, namespace="ns",
                         annotations={"katalyst.kubewharf.io/qos_level": level})
    pod.linux.cgroup_parent = f"/kubepods/burstable/poduid-{pod_id}"
    return pod


def test_first_sight_converts_and_resolves() -> None:
    views = PodViews()
    view = views.view(sandbox("a"), QosConfig())
    assert (view.pod.id, view.pod.uid, view.decision.level, view.decision.source) == (
        "a", "uid-a", "reclaimed_cores", "katalyst")
    assert len(views) == 1


def test_later_events_reuse_the_view() -> None:
    views, qos = PodViews(), QosConfig()
    first = views.view(sandbox("a"), qos)
    # The same sandbox id: what CRI fixed at creation cannot have changed, so it is not redone.
    assert views.view(sandbox("a", level="dedicated_cores"), qos) is first


def test_a_new_qos_section_resolves_again_with_the_same_pod() -> None:
    views, qos = PodViews(), QosConfig()
    first = views.view(sandbox("a"), qos)
    assert first.decision.source == "katalyst"
    without_katalyst = replace(qos, sources=tuple(s for s in qos.sources if s != "katalyst"))
    second = views.view(sandbox("a"), without_katalyst)
    assert second.pod is first.pod
    assert (second.decision.level, second.decision.source) == ("shared_cores", "kubernetes_qos")
    assert views.view(sandbox("a"), without_katalyst) is second


def test_forget_and_clear() -> None:
    views, qos = PodViews(), QosConfig()
    first = views.view(sandbox("a"), qos)
    views.view(sandbox("b"), qos)
    views.forget("a")
    views.forget("never-seen")
    assert len(views) == 1
    assert views.view(sandbox("a"), qos) is not first
    views.clear()
    assert len(views) == 0


def test_oldest_pushed_out_beyond_the_limit() -> None:
    views, qos = PodViews(limit=2), QosConfig()
    first = views.view(sandbox("a"), qos)
    views.view(sandbox("b"), qos)
    views.view(sandbox("c"), qos)
    assert len(views) == 2
    assert views.view(sandbox("a"), qos) is not first  # "a" had been pushed out


def test_invalid_sandbox_is_not_remembered() -> None:
    views = PodViews()
    with pytest.raises(InvalidInput, match="no id"):
        views.view(api.PodSandbox(uid="u"), QosConfig())
    assert len(views) == 0


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PodViews(limit=0)
