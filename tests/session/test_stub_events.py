"""The plugin stub's events against the runtime simulator over a real unix socket: every event,
split Synchronize, container updates, request timeouts, metrics and the connection state."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.metrics import PluginMetrics
from common.state import NodeState
from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo
from hooks.settings import ContainerSettings
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.scenario import RuntimeSpec
from nri_plugin.wire.errors import RpcError
from nri_plugin.wire.nri_api import PLUGIN_SERVICE
from nri_plugin.wire.status import StatusCode
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as envelope
from tests.support.raw_runtime import plugin_config
from tests.support.stub_runtime import OLD_RUNTIME, Recorder, configure, container, pod, requests

ALL_EVENTS = [e for e in Event if e is not Event.VALIDATE_CONTAINER_ADJUSTMENT]


@pytest.mark.parametrize("runtime", [RuntimeSpec(), OLD_RUNTIME], ids=["dedicated", "statechange"])
async def test_every_event_reaches_capabilities(make, runtime: RuntimeSpec) -> None:
    capability = Recorder("all", ALL_EVENTS)
    setup = await make([capability], runtime=runtime)
    sent = []
    for event in ALL_EVENTS:
        if not setup.conn.subscribed(event):
            continue
        ctr = None if event in (Event.RUN_POD_SANDBOX, Event.STOP_POD_SANDBOX,
                                Event.REMOVE_POD_SANDBOX, Event.UPDATE_POD_SANDBOX,
                                Event.POST_UPDATE_POD_SANDBOX) else container()
        await setup.simulator.send(setup.conn, event, pod(), ctr)
        sent.append(event.name.lower())
    assert [call[0] for call in capability.calls] == sent
    methods = {answer.method for answer in setup.conn.answers}
    if runtime.nri_version:
        assert "StateChange" not in methods
        assert len(sent) == len(ALL_EVENTS)
    else:
        assert "StateChange" in methods
        assert len(sent) == 11


async def test_unknown_state_change_event_fails_open(make) -> None:
    setup = await make(runtime=OLD_RUNTIME)
    assert setup.conn.peer is not None
    bogus = api.StateChangeEvent(event=99, pod=pod())  # type: ignore[arg-type]
    reply = await setup.conn.peer.call("nri.pkg.api.v1alpha1.Plugin", "StateChange",
                                       bogus.SerializeToString(), timeout_s=2)
    assert reply == b""
    assert "unknown event 99" in setup.sink.named("event_failed")[0]["reason"]


async def test_validate_is_unimplemented_and_shutdown_is_a_no_op(make) -> None:
    setup = await make()
    assert setup.conn.peer is not None
    with pytest.raises(RpcError) as error:
        await setup.conn.peer.call("nri.pkg.api.v1alpha1.Plugin", "ValidateContainerAdjustment",
                                   b"", timeout_s=2)
    assert (error.value.code, error.value.message) == (
        StatusCode.UNIMPLEMENTED, "method ValidateContainerAdjustment")
    assert await setup.conn.peer.call("nri.pkg.api.v1alpha1.Plugin", "Shutdown", b"",
                                      timeout_s=2) == b""


async def test_split_synchronize_is_accumulated(make) -> None:
    capability = Recorder("h")
    pods = [pod(f"uid-{i}") for i in range(5)]
    containers = [container(f"c{i}", f"uid-{i}") for i in range(3)]
    setup = await make([capability], runtime=RuntimeSpec(sync_chunk=2), pods=pods,
                       containers=containers)
    assert [r.more for r in setup.conn.sync_responses] == [True, True, False]
    assert capability.synced == [([f"uid-{i}" for i in range(5)], ["c0", "c1", "c2"])]


async def test_update_containers_from_outside_a_handler(make) -> None:
    setup = await make()
    update = api.ContainerUpdate(container_id="c1")
    update.linux.resources.memory.limit.value = 1 << 30
    assert await setup.stub.update_containers([update]) == []
    assert [u.container_id for u in setup.conn.updates] == ["c1"]


async def test_update_containers_refused_inside_a_handler(make, executor, monkeypatch) -> None:
    errors: list[Exception] = []

    class Eager(Recorder):
        stub: PluginStub

    capability = Eager("eager", (Event.RUN_POD_SANDBOX,))
    setup = await make([capability])
    # Call from the handler's own task context, as a handler would.
    original = setup.stub.events.handle

    async def update_then_finish(handled: Awaitable[bytes]) -> bytes:
        try:
            await setup.stub.update_containers([])
        except RuntimeError as exc:
            errors.append(exc)
        return await handled

    def event_then_update(*args: Any) -> bytes | Awaitable[bytes]:
        handled = original(*args)
        assert not isinstance(handled, bytes)
        return update_then_finish(handled)

    monkeypatch.setattr(setup.stub.events, "handle", event_then_update)
    await setup.simulator.send(setup.conn, Event.RUN_POD_SANDBOX, pod())
    assert len(errors) == 1
    assert "must not be awaited" in str(errors[0])


@pytest.mark.parametrize("timeout_ms", [-5, 0, 10**13])
async def test_absurd_request_timeouts_mean_the_default(make, timeout_ms: int) -> None:
    setup = await make(runtime=RuntimeSpec(request_timeout_ms=2000))
    request = api.ConfigureRequest(runtime_name="containerd", runtime_version="v2.1.0",
                                   request_timeout=timeout_ms, registration_timeout=timeout_ms)
    setup.stub.handlers[(PLUGIN_SERVICE, "Configure")](envelope_request("Configure", request))
    assert setup.stub.terms.request_timeout_ms == 2000
    assert setup.stub.deadline_ms() == 1500
    assert setup.stub.handshake.registration_timeout_ms == 5000


def envelope_request(method: str, message: Any) -> Any:

    return envelope.Request(service="nri.pkg.api.v1alpha1.Plugin", method=method,
                            payload=message.SerializeToString())


async def test_split_synchronize_chunks_share_one_budget(executor: ThreadPoolExecutor) -> None:
    # The runtime gives the whole split Synchronize one request timeout: the capabilities of the
    # last chunk only get what the earlier chunks left of the deadline.
    now = [0.0]
    release = threading.Event()

    class SlowSync(Capability):
        name = "slow-sync"

        def synchronize(self, pods: Sequence[PodInfo],
                        containers: Sequence[ContainerInfo]) -> None:
            release.wait(10)

    sink = MemoryAuditSink()
    stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=Config,
                      capabilities=[SlowSync()], audit=AuditLog(sink), executor=executor,
                      state=NodeState(), clock=lambda: now[0])
    first = api.SynchronizeRequest(pods=[pod("uid-1")], more=True)
    last = api.SynchronizeRequest(pods=[pod("uid-2")], more=False)
    configure(stub)
    synchronize = stub.handlers[(PLUGIN_SERVICE, "Synchronize")]
    await synchronize(envelope_request("Synchronize", first))  # type: ignore[misc]
    now[0] = 1.45  # 1450 ms of the 1500 ms deadline gone
    started = time.monotonic()
    try:
        answer = api.SynchronizeResponse.FromString(
            await synchronize(envelope_request("Synchronize", last)))  # type: ignore[misc]
    finally:
        release.set()
    assert answer.more is False
    assert time.monotonic() - started < 1.0  # about 50 ms, far from a fresh 1.5 s
    (failed,) = sink.named("event_failed")
    assert "deadline of 50 ms" in failed["reason"]


async def test_metrics_count_every_answer_by_result(make) -> None:
    """ok, fail-open (a failing capability, unusable input, an undecodable payload) and error
    (strict): each answer is counted once, after it was sent."""
    metrics = PluginMetrics()
    ok = Recorder("ok", settings=ContainerSettings(annotations={"ok": "1"}))
    bad = Recorder("bad", error=OSError("resctrl gone"))
    setup = await make([ok], metrics=metrics)
    await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    await asyncio.sleep(0)  # counted on the loop's next turn, after the answer
    assert requests(metrics, "create_container", "ok") == 1
    assert requests(metrics, "synchronize", "ok") == 1
    count = metrics.registry.get_sample_value(
        "nri_qos_nri_request_duration_seconds_count", {"event": "create_container"})
    assert count == 1
    assert metrics.registry.get_sample_value(
        "nri_qos_nri_adjusted_fields_total", {"field": "annotations"}) == 1
    assert metrics.registry.get_sample_value(
        "nri_qos_nri_connection_state", {"state": "synchronized"}) == 1
    assert metrics.registry.get_sample_value(
        "nri_qos_nri_runtime_info",
        {"runtime": "containerd", "version": setup.simulator.runtime.version,
         "nri_version": setup.simulator.runtime.nri_version}) == 1

    failing = await make([bad, ok], metrics=metrics)
    await failing.simulator.send(failing.conn, Event.CREATE_CONTAINER, pod(), container())
    await failing.simulator.send(failing.conn, Event.CREATE_CONTAINER, pod(), container(cid=""))
    await failing.conn.peer.call(PLUGIN_SERVICE, "CreateContainer", b"\xff\xff",  # type: ignore[union-attr]
                                 timeout_s=2)
    await asyncio.sleep(0)
    assert requests(metrics, "create_container", "fail-open") == 3

    strict = await make([bad, ok], cfg=plugin_config(strict=True), metrics=metrics)
    with pytest.raises(RpcError):
        await strict.simulator.send(strict.conn, Event.CREATE_CONTAINER, pod(), container())
    with pytest.raises(RpcError):
        await strict.conn.peer.call(PLUGIN_SERVICE, "CreateContainer", b"\xff\xff",  # type: ignore[union-attr]
                                    timeout_s=2)
    await asyncio.sleep(0)
    assert requests(metrics, "create_container", "error") == 2
    assert requests(metrics, "create_container", "ok") == 1


async def test_connection_state_follows_the_session(make) -> None:
    metrics = PluginMetrics()
    setup = await make(metrics=metrics)
    stub = setup.stub
    assert stub.connection_state == "synchronized"
    assert stub.connections == 1
    assert 0 <= stub.state_age_s() < 5
    since = metrics.registry.get_sample_value("nri_qos_nri_connection_state_timestamp_seconds")
    assert since is not None
    assert abs(since - time.time()) < 5
    stub.close()
    await setup.serving
    assert stub.connection_state == "disconnected"
    assert metrics.registry.get_sample_value(
        "nri_qos_nri_connection_state", {"state": "disconnected"}) == 1
    assert metrics.registry.get_sample_value(
        "nri_qos_nri_connection_state", {"state": "synchronized"}) == 0
