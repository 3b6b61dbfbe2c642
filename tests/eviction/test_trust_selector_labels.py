"""An eviction exclusion selector sees the labels it names on pods as the agent keeps them: the
runtime's copy and the pod watch's both go through the configuration's read keys first."""

from __future__ import annotations

import dataclasses

import pytest

from common.podmeta import pod_meta_from_object
from common.state import NodeState
from nri_plugin.config.schema import Config
from nri_plugin.wire.convert import convert_pod
from protos import nri_api_pb2 as api
from reconciler.eviction.api import ActivePod
from reconciler.eviction.choice import PodFacts, PodFilter
from tests.support.fake_apiserver import make_pod

UID = "0f1e2d3c-0000-4000-8000-000000000001"
PARENT = f"/kubepods/besteffort/pod{UID}"


def _config(*selectors: str) -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, eviction=dataclasses.replace(
        cfg.eviction, exclude_selectors=selectors, exclude_selector_namespaces=("batch",)))


def _sandbox(labels: dict[str, str]) -> api.PodSandbox:
    sandbox = api.PodSandbox(id="sandbox-1", uid=UID, name="infra", namespace="batch",
                             labels=labels)
    sandbox.linux.cgroup_parent = PARENT
    return sandbox


def _why_not(cfg: Config, state: NodeState, *, need_description: bool) -> str | None:
    """The filter's verdict on the pod as the eviction round's facts describe it."""
    view = state.snapshot().pods["sandbox-1"]
    info = view.info
    facts = PodFacts(ActivePod(info.uid, info.namespace, info.name, view.level, info.priority,
                               None, None),
                     info.labels, info.annotations, terminating=False,
                     described=view.meta is not None)
    return PodFilter(cfg.eviction).why_not(facts, need_description=need_description)


@pytest.mark.parametrize("selector", ["team=infra", "team in (infra,ops)", "team"])
def test_a_selector_spares_a_pod_by_the_labels_the_runtime_gave(selector: str) -> None:
    cfg = _config(selector)
    state = NodeState()
    state.replace_all([convert_pod(_sandbox({"team": "infra"}), cfg.read_keys()).info], [])
    assert _why_not(cfg, state, need_description=False) == \
        f"labels match excluded selector {selector!r}"


def test_a_selector_spares_a_pod_by_the_labels_the_pod_watch_reports() -> None:
    cfg = _config("team=infra")
    keys = cfg.read_keys()
    state = NodeState()
    state.replace_all([convert_pod(_sandbox({}), keys).info], [])
    obj = make_pod("infra", namespace="batch", uid=UID, labels={"team": "infra"})
    state.apply_meta(pod_meta_from_object(obj).trimmed(keys))
    assert _why_not(cfg, state, need_description=True) == \
        "labels match excluded selector 'team=infra'"


def test_a_negated_selector_does_not_spare_a_pod_carrying_the_value() -> None:
    # "!=" matches a pod without the key: a label dropped on the way would spare every pod.
    cfg = _config("team!=batch")
    state = NodeState()
    state.replace_all([convert_pod(_sandbox({"team": "batch"}), cfg.read_keys()).info], [])
    assert _why_not(cfg, state, need_description=False) is None


def test_labels_no_selector_names_are_still_dropped_at_the_door() -> None:
    cfg = _config("team=infra")
    pod = convert_pod(_sandbox({"team": "infra", "other": "x" * 60}), cfg.read_keys()).info
    assert dict(pod.labels) == {"team": "infra"}
