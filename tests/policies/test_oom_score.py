"""oom_score_adj policy: level scores, the pod annotation within the floor, tier ordering."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from hooks.model import ContainerInfo, PodInfo
from hooks.oom_score import OomConfig, oom_score
from tests.support.builders import pod

CFG = OomConfig()
ANN = CFG.annotation


def ctr(kubelet: int | None = None) -> ContainerInfo:
    return ContainerInfo(id="c1", pod_sandbox_id="sb", name="c", oom_score_adj=kubelet)


def score(level: str, annotations: dict[str, str] | None = None, *, cfg: OomConfig = CFG,
          kubelet: int | None = None) -> int | None:
    decision = oom_score(pod(annotations), ctr(kubelet), level, cfg)
    assert decision.problems == ()
    return decision.settings.oom_score_adj


@pytest.mark.parametrize(("level", "expected"), [
    ("reclaimed_cores", 1000),
    ("dedicated_cores", None),   # kubelet's value stays
    ("shared_cores", None),
    ("system_cores", None),
    ("unknown_level", None),
])
def test_level_defaults(level: str, expected: int | None) -> None:
    assert score(level, kubelet=-997) == expected


@pytest.mark.parametrize(("level", "value", "expected"), [
    ("shared_cores", "500", 500),
    ("shared_cores", " 2 ", 2),
    ("shared_cores", "+1000", 1000),
    ("dedicated_cores", "-998", -998),
    ("reclaimed_cores", "1000", 1000),
])
def test_annotation_within_bounds(level: str, value: str, expected: int) -> None:
    assert score(level, {ANN: value}) == expected


@pytest.mark.parametrize(("level", "value", "why"), [
    ("shared_cores", "1", "outside [2, 1000]"),          # below the level floor
    ("shared_cores", "-1000", "outside [2, 1000]"),
    ("dedicated_cores", "-999", "outside [-998, 1000]"),
    ("reclaimed_cores", "999", "outside [1000, 1000]"),
    ("shared_cores", "1001", "outside"),
    ("shared_cores", "99999", "outside"),
    ("shared_cores", "999999999999", "not an integer"),
    ("shared_cores", "", "not an integer"),
    ("shared_cores", "abc", "not an integer"),
    ("shared_cores", "1.5", "not an integer"),
    ("shared_cores", "0x10", "not an integer"),
    ("shared_cores", "--5", "not an integer"),
    ("shared_cores", "5; rm -rf /", "not an integer"),
])
def test_bad_annotations_are_rejected(level: str, value: str, why: str) -> None:
    decision = oom_score(pod({ANN: value}), ctr(), level, CFG)
    assert len(decision.problems) == 1
    assert why in decision.problems[0]
    # The level's own value stays: reclaimed keeps 1000, the others kubelet's.
    expected = 1000 if level == "reclaimed_cores" else None
    assert decision.settings.oom_score_adj == expected


def test_custom_level_score() -> None:
    levels = dict(CFG.levels)
    levels["shared_cores"] = dataclasses.replace(levels["shared_cores"], set_score=True, score=300)
    cfg = dataclasses.replace(CFG, levels=MappingProxyType(levels))
    assert score("shared_cores", cfg=cfg) == 300
    assert score("shared_cores", {ANN: "400"}, cfg=cfg) == 400


ORDERED = dataclasses.replace(CFG, priority_ordering=True, offline_min_score=500)


@pytest.mark.parametrize(("level", "annotation", "kubelet", "expected"), [
    ("reclaimed_cores", None, None, 1000),
    ("reclaimed_cores", None, -997, 1000),
    ("shared_cores", None, 1000, 499),     # a BestEffort pod classified online
    ("shared_cores", None, 300, None),     # already below the offline tier
    ("shared_cores", "900", None, 499),
    ("dedicated_cores", None, -997, None),
    ("shared_cores", None, None, None),    # unknown kubelet value: nothing to order
])
def test_priority_ordering(level: str, annotation: str | None, kubelet: int | None,
                           expected: int | None) -> None:
    ann = {ANN: annotation} if annotation is not None else None
    assert score(level, ann, cfg=ORDERED, kubelet=kubelet) == expected


def test_ordering_lifts_offline_scores_to_the_tier() -> None:
    levels = dict(CFG.levels)
    levels["reclaimed_cores"] = dataclasses.replace(levels["reclaimed_cores"], score=100, floor=0)
    cfg = dataclasses.replace(ORDERED, levels=MappingProxyType(levels))
    assert score("reclaimed_cores", cfg=cfg) == 500
    assert score("reclaimed_cores", {ANN: "700"}, cfg=cfg) == 700


def test_annotation_cannot_go_below_kubelets_value() -> None:
    # A BestEffort container (kubelet: 1000) that names itself dedicated_cores may not use the
    # level's low floor to protect itself.
    container = ContainerInfo("c", "s", "n", oom_score_adj=1000)
    decision = oom_score(PodInfo("s", "u", "p", "ns", annotations={ANN: "-998"}),
                         container, "dedicated_cores", OomConfig())
    assert decision.settings.oom_score_adj is None
    assert any("outside [1000, 1000]" in p for p in decision.problems)
    burstable = ContainerInfo("c", "s", "n", oom_score_adj=600)
    raised = oom_score(PodInfo("s", "u", "p", "ns", annotations={ANN: "900"}),
                       burstable, "shared_cores", OomConfig())
    assert raised.settings.oom_score_adj == 900
