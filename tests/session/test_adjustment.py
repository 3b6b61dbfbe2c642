"""adjustment.decide: which route each field the policies set takes on a given runtime."""

from __future__ import annotations

from hooks.settings import ContainerSettings, HookStage, OciHookSpec
from nri_plugin.session.adjustment import FIELD_NAMES, decide, encode, route, routes, set_fields
from nri_plugin.wire.runtime_support import RuntimeSupport
from protos import nri_api_pb2 as api

RECONCILED = frozenset({"oom_score_adj", "unified", "memory_limit", "memory_reservation",
                        "rdt_class"})
# containerd 1.7.27 applies oom_score_adj; 1.7.20 does not (docs/nri-protocol.md).
APPLIES_OOM = RuntimeSupport.detect("0.8.0", "containerd", "v1.7.27")
DROPS_OOM = RuntimeSupport.detect("0.8.0", "containerd", "v1.7.20")


def test_oom_score_adj_zero_is_a_value_the_answer_carries() -> None:
    decided = decide([("oom", ContainerSettings(oom_score_adj=0))], APPLIES_OOM, "auto",
                     RECONCILED)
    assert decided.settings.oom_score_adj == 0
    assert decided.deferred == ()
    assert decided.dropped == ()
    response = api.CreateContainerResponse.FromString(encode(decided))
    assert response.adjust.linux.oom_score_adj.value == 0
    assert response.adjust.linux.HasField("oom_score_adj")


def test_oom_score_adj_zero_the_runtime_drops_goes_to_the_reconciler() -> None:
    decided = decide([("oom", ContainerSettings(oom_score_adj=0))], DROPS_OOM, "auto",
                     RECONCILED)
    assert decided.settings.oom_score_adj is None
    assert decided.deferred == ("oom_score_adj",)


def test_oom_score_adj_zero_nothing_applies_is_reported_dropped() -> None:
    decided = decide([("oom", ContainerSettings(oom_score_adj=0))], DROPS_OOM, "auto",
                     frozenset())
    assert decided.settings.oom_score_adj is None
    assert decided.dropped == (("oom_score_adj",
                                "runtime does not apply oom_score_adj adjustments"),)



def test_routes_sort_every_field_by_its_route() -> None:
    found = routes(DROPS_OOM, "auto", RECONCILED)
    assert "oom_score_adj" in found["reconciler"]
    assert "oom_score_adj" in routes(APPLIES_OOM, "auto", RECONCILED)["adjustment"]
    assert sorted(f for fields in found.values() for f in fields) == sorted(FIELD_NAMES)
    for way, fields in found.items():
        assert fields == [f for f in FIELD_NAMES if route(f, DROPS_OOM, "auto", RECONCILED) == way]


def test_set_fields_names_each_value_and_each_key() -> None:
    settings = ContainerSettings(
        rdt_class="be", unified={"memory.high": "1", "memory.low": "0"}, memory_reservation=5,
        oom_score_adj=0, annotations={"a": "1"},
        hooks=(OciHookSpec(stage=HookStage.POSTSTOP, path="/bin/true"),))
    assert set_fields(settings) == [
        "rdt_class", "memory_reservation", "oom_score_adj", "unified.memory.high",
        "unified.memory.low", "annotations.a", "hooks"]
    assert set_fields(ContainerSettings()) == []
