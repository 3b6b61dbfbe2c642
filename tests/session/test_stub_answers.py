"""The plugin stub's answers against the runtime simulator over a real unix socket: registration,
the event mask, merged capabilities, the CLOS field and oom_score_adj by runtime version."""

from __future__ import annotations

import pytest

from hooks.events import Event
from hooks.settings import ContainerSettings, HookStage, OciHookSpec
from nri_plugin.sim.scenario import RuntimeSpec
from protos import nri_api_pb2 as api
from tests.support.stub_runtime import OLD_RUNTIME, Recorder, container, pod

ANCIENT_RUNTIME = RuntimeSpec(version="1.7.20-0ubuntu1", nri_version="", request_timeout_ms=0,
                              registration_timeout_ms=0)


async def test_registers_with_name_index_and_version(make) -> None:
    setup = await make()
    assert (setup.conn.name, setup.conn.index, setup.conn.nri_version) == (
        "nri-qos", "10", "v0.12.2")


async def test_mask_is_capabilities_plus_state_events_within_new_runtime(make) -> None:
    capability = Recorder("h", (Event.UPDATE_POD_SANDBOX, Event.START_CONTAINER,
                          Event.VALIDATE_CONTAINER_ADJUSTMENT))
    setup = await make([capability])
    expected = {Event.RUN_POD_SANDBOX, Event.REMOVE_POD_SANDBOX, Event.CREATE_CONTAINER,
                Event.REMOVE_CONTAINER, Event.UPDATE_POD_SANDBOX, Event.START_CONTAINER}
    assert setup.conn.events == sum(e.bit for e in expected)


@pytest.mark.parametrize("runtime", [OLD_RUNTIME, ANCIENT_RUNTIME])
async def test_mask_never_exceeds_old_runtime_limit(make, runtime: RuntimeSpec) -> None:
    # The simulator drops a plugin whose mask has bits outside 0x7ff, as the runtime does.
    capability = Recorder("h", (Event.UPDATE_POD_SANDBOX, Event.POST_UPDATE_POD_SANDBOX))
    setup = await make([capability], runtime=runtime)
    assert setup.conn.events & ~0x7FF == 0
    assert setup.conn.events != 0
    assert setup.conn.alive


async def test_create_container_merges_capabilities_and_audits_conflicts(make) -> None:
    first = Recorder("first", settings=ContainerSettings(
        oom_score_adj=1000, annotations={"a": "1"},
        hooks=(OciHookSpec(HookStage.PRESTART, "/bin/true", ("true",), timeout_s=5),)))
    second = Recorder("second", settings=ContainerSettings(
        oom_score_adj=500, unified={"memory.high": "1000"}, memory_limit=1 << 30))
    setup = await make([first, second])
    response = await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    assert isinstance(response, api.CreateContainerResponse)
    adjust = response.adjust
    assert adjust.linux.oom_score_adj.value == 1000
    assert dict(adjust.annotations) == {"a": "1"}
    assert dict(adjust.linux.resources.unified) == {"memory.high": "1000"}
    assert adjust.linux.resources.memory.limit.value == 1 << 30
    assert [(h.path, list(h.args), h.timeout.value) for h in adjust.hooks.prestart] == [
        ("/bin/true", ["true"], 5)]
    conflicts = setup.sink.named("adjustment_conflict")
    assert [(c["field"], c["kept_owner"], c["rejected_owner"]) for c in conflicts] == [
        ("oom_score_adj", "first", "second")]
    assert setup.sink.named("adjustment_applied")[0]["container"] == "name-c1"


async def test_capabilities_get_resolved_level_and_bad_values_are_audited(make) -> None:
    capability = Recorder("h", (Event.RUN_POD_SANDBOX, Event.CREATE_CONTAINER))
    setup = await make([capability])
    offline = pod("uid-2", **{"qos.nri-qos.io/level": "reclaimed_cores"})
    weird = pod("uid-3", **{"qos.nri-qos.io/level": "turbo"})
    await setup.simulator.send(setup.conn, Event.RUN_POD_SANDBOX, offline)
    await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, weird, container("c3", "uid-3"))
    assert capability.calls[0] == ("run_pod_sandbox", "uid-2", "reclaimed_cores")
    # The bad annotation falls through to the QoS class of the cgroup parent (besteffort).
    assert capability.calls[1] == ("create_container", "c3", "reclaimed_cores")
    skipped = setup.sink.named("adjustment_skipped")
    assert any("turbo" in record["reason"] for record in skipped)


@pytest.mark.parametrize(("runtime", "field"), [
    (RuntimeSpec(), "clos_id"), (OLD_RUNTIME, "rdt_class")])
async def test_clos_field_follows_runtime(make, runtime: RuntimeSpec, field: str) -> None:
    capability = Recorder("rdt", settings=ContainerSettings(rdt_class="nriqos-reclaimed_cores"))
    setup = await make([capability], runtime=runtime)
    response = await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    assert isinstance(response, api.CreateContainerResponse)
    adjust = response.adjust
    if field == "clos_id":
        assert adjust.linux.rdt.clos_id.value == "nriqos-reclaimed_cores"
        assert not adjust.linux.resources.HasField("rdt_class")
    else:
        assert adjust.linux.resources.rdt_class.value == "nriqos-reclaimed_cores"
        assert not adjust.linux.HasField("rdt")


BEFORE_OOM = RuntimeSpec(version="v1.7.25", nri_version="", request_timeout_ms=0)


async def test_oom_score_adj_dropped_where_runtime_ignores_it(make) -> None:
    capability = Recorder("oom", settings=ContainerSettings(oom_score_adj=1000))
    setup = await make([capability], runtime=BEFORE_OOM)
    response = await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    assert isinstance(response, api.CreateContainerResponse)
    assert not response.adjust.linux.HasField("oom_score_adj")
    assert "oom_score_adj" in setup.sink.named("adjustment_skipped")[0]["reason"]


async def test_oom_score_adj_answered_from_containerd_1_7_26(make) -> None:
    # containerd 1.7.26+ vendors NRI 0.8.0, whose adaptation applies oom_score_adj.
    capability = Recorder("oom", settings=ContainerSettings(oom_score_adj=1000))
    setup = await make([capability], runtime=OLD_RUNTIME)
    response = await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    assert isinstance(response, api.CreateContainerResponse)
    assert response.adjust.linux.oom_score_adj.value == 1000
    assert setup.sink.named("adjustment_skipped") == []


async def test_oom_score_adj_left_to_the_reconciler_where_runtime_ignores_it(make) -> None:
    capability = Recorder("oom", settings=ContainerSettings(oom_score_adj=1000,
                                                            annotations={"a": "b"}))
    setup = await make([capability], runtime=BEFORE_OOM,
                       reconciler_fields=frozenset({"oom_score_adj"}))
    response = await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    assert isinstance(response, api.CreateContainerResponse)
    assert not response.adjust.linux.HasField("oom_score_adj")
    assert dict(response.adjust.annotations) == {"a": "b"}
    (deferred,) = setup.sink.named("adjustment_deferred")
    assert (deferred["field"], deferred["container"]) == ("oom_score_adj", "name-c1")
    assert "reconciler" in deferred["applied_by"]
    assert setup.sink.named("adjustment_skipped") == []
