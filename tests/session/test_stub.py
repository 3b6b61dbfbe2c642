"""The plugin stub against the runtime simulator over a real unix socket."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.metrics import PluginMetrics
from common.state import NodeState
from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo
from hooks.settings import EMPTY_SETTINGS, ContainerSettings, HookStage, OciHookSpec
from nri_plugin.config.schema import Config
from nri_plugin.obs.logs import LoggingConfig, LoggingSetup
from nri_plugin.session.capability import Capability, ContainerEvent, PodEvent
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.scenario import RuntimeSpec
from nri_plugin.sim.simulator import PluginConnection, RuntimeSimulator
from nri_plugin.wire.errors import RpcError
from nri_plugin.wire.nri_api import PLUGIN_SERVICE
from nri_plugin.wire.status import StatusCode
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as envelope
from tests.support.raw_runtime import plugin_config

OLD_RUNTIME = RuntimeSpec(version="v1.7.27", nri_version="", request_timeout_ms=2000)
ANCIENT_RUNTIME = RuntimeSpec(version="1.7.20-0ubuntu1", nri_version="", request_timeout_ms=0,
                              registration_timeout_ms=0)


class Recorder(Capability):
    """A capability that records its calls and answers CreateContainer with fixed settings."""

    def __init__(self, name: str, events: Sequence[Event] = (Event.CREATE_CONTAINER,), *,
                 settings: ContainerSettings = EMPTY_SETTINGS, block: threading.Event | None = None,
                 error: BaseException | None = None, inline: bool = False) -> None:
        self.name = name
        self.events = frozenset(events)
        self.inline_events = self.events if inline else frozenset()
        self.settings = settings
        self.block = block
        self.error = error
        self.calls: list[tuple[str, str, str]] = []
        self.synced: list[tuple[list[str], list[str]]] = []

    def _act(self) -> None:
        if self.block is not None:
            self.block.wait(10)
        if self.error is not None:
            raise self.error

    def run_pod_sandbox(self, event: PodEvent) -> None:
        self.calls.append(("run_pod_sandbox", event.pod.uid, event.level))
        self._act()

    def remove_pod_sandbox(self, event: PodEvent) -> None:
        self.calls.append(("remove_pod_sandbox", event.pod.uid, event.level))

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        self.calls.append(("create_container", event.container.id, event.level))
        self._act()
        return self.settings

    def observe(self, event: Event, pod: PodInfo, container: ContainerInfo | None) -> None:
        self.calls.append((event.name.lower(), pod.uid, container.id if container else ""))

    def synchronize(self, pods: Sequence[PodInfo], containers: Sequence[ContainerInfo]) -> None:
        self.synced.append(([p.uid for p in pods], [c.id for c in containers]))


def pod(uid: str = "uid-1", **annotations: str) -> api.PodSandbox:
    message = api.PodSandbox(id=f"sb-{uid}", uid=uid, name=f"pod-{uid}", namespace="ns",
                             annotations=annotations)
    message.linux.cgroup_parent = f"/kubepods/besteffort/pod{uid}"
    return message


def container(cid: str = "c1", uid: str = "uid-1", limit: int = 512 << 20) -> api.Container:
    message = api.Container(id=cid, pod_sandbox_id=f"sb-{uid}", name=f"name-{cid}")
    message.linux.resources.memory.limit.value = limit
    return message


class Setup:
    def __init__(self, simulator: RuntimeSimulator, stub: PluginStub, sink: MemoryAuditSink,
                 serving: asyncio.Task[str]) -> None:
        self.simulator = simulator
        self.stub = stub
        self.sink = sink
        self.serving = serving
        self.connection: PluginConnection | None = None

    @property
    def conn(self) -> PluginConnection:
        assert self.connection is not None
        return self.connection


@pytest.fixture
async def make(tmp_path: Path, executor: ThreadPoolExecutor) -> AsyncIterator[object]:
    setups: list[Setup] = []

    async def start(capabilities: Sequence[Capability] = (), *, runtime: RuntimeSpec | None = None,
                    cfg: Config | None = None, pods: Sequence[api.PodSandbox] = (),
                    containers: Sequence[api.Container] = (), wait: bool = True,
                    identity: PluginIdentity | None = None,
                    reconciler_fields: frozenset[str] = frozenset(),
                    metrics: PluginMetrics | None = None) -> Setup:
        socket_path = tmp_path / f"nri-{len(setups)}.sock"
        simulator = RuntimeSimulator(socket_path, runtime, pods=pods, containers=containers)
        await simulator.start()
        sink = MemoryAuditSink()
        current = cfg or Config()
        stub = PluginStub(identity=identity or PluginIdentity("nri-qos", "10"),
                          config=lambda: current, capabilities=capabilities,
                          audit=AuditLog(sink), executor=executor, state=NodeState(),
                          reconciler_fields=reconciler_fields, metrics=metrics)
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        setup = Setup(simulator, stub, sink, asyncio.create_task(stub.serve(reader, writer)))
        setups.append(setup)
        if wait:
            setup.connection = await simulator.wait_ready()
        return setup

    yield start
    for setup in setups:
        setup.stub.close()
        await setup.serving
        await setup.simulator.stop()


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


async def test_slow_capability_answers_partial_adjustment_before_deadline(make) -> None:
    block = threading.Event()
    fast = Recorder("fast", settings=ContainerSettings(annotations={"fast": "yes"}))
    slow = Recorder("slow", settings=ContainerSettings(annotations={"slow": "yes"}), block=block)
    setup = await make([fast, slow], cfg=plugin_config(deadline_ms=200))
    started = time.monotonic()
    response = await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    elapsed = time.monotonic() - started
    block.set()
    assert isinstance(response, api.CreateContainerResponse)
    assert dict(response.adjust.annotations) == {"fast": "yes"}
    # Generous bound: well under the runtime's 2 s request timeout.
    assert elapsed < 1.5
    reasons = [r["reason"] for r in setup.sink.named("adjustment_skipped")]
    assert any("deadline" in r and "slow" in r for r in reasons)
    assert setup.conn.alive


async def test_slow_capability_in_strict_mode_answers_error(make) -> None:
    block = threading.Event()
    slow = Recorder("slow", block=block)
    setup = await make([slow], cfg=plugin_config(deadline_ms=100, strict=True))
    with pytest.raises(RpcError) as error:
        await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    block.set()
    assert error.value.code == StatusCode.DEADLINE_EXCEEDED
    assert "slow" in error.value.message
    assert setup.conn.alive


async def test_deadline_stays_below_runtime_timeout(make) -> None:
    setup = await make(runtime=RuntimeSpec(request_timeout_ms=600),
                       cfg=plugin_config(deadline_ms=1500))
    assert setup.stub.deadline_ms() == 600 - Config().plugin.deadline_margin_ms


async def test_failing_capability_fails_open_or_strict(make) -> None:
    ok = Recorder("ok", settings=ContainerSettings(annotations={"ok": "1"}))
    bad = Recorder("bad", error=OSError("resctrl gone"))
    setup = await make([bad, ok])
    response = await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    assert isinstance(response, api.CreateContainerResponse)
    assert dict(response.adjust.annotations) == {"ok": "1"}
    assert "resctrl gone" in setup.sink.named("adjustment_skipped")[0]["reason"]

    strict = await make([bad, ok], cfg=plugin_config(strict=True))
    with pytest.raises(RpcError) as error:
        await strict.simulator.send(strict.conn, Event.CREATE_CONTAINER, pod(), container())
    assert error.value.code == StatusCode.UNKNOWN
    assert "resctrl gone" in error.value.message


async def test_invalid_input_fails_open_or_strict(make) -> None:
    capability = Recorder("h", settings=ContainerSettings(annotations={"x": "1"}))
    setup = await make([capability])
    nameless = container(cid="")
    response = await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), nameless)
    assert isinstance(response, api.CreateContainerResponse)
    assert response.adjust.ByteSize() == 0
    assert "invalid input" in setup.sink.named("adjustment_skipped")[0]["reason"]
    assert capability.calls == []

    strict = await make([capability], cfg=plugin_config(strict=True))
    with pytest.raises(RpcError) as error:
        await strict.simulator.send(strict.conn, Event.CREATE_CONTAINER, pod(), nameless)
    assert error.value.code == StatusCode.INVALID_ARGUMENT


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


async def test_registration_rejected_closes_connection(make) -> None:
    setup = await make(identity=PluginIdentity("nri-qos", "1"), wait=False)
    reason = await setup.serving
    assert "registration failed" in reason
    assert setup.simulator.connections[0].ready.is_set() is False


async def test_failing_synchronize_stays_connected_even_when_strict(make) -> None:
    class BrokenSync(Recorder):
        def synchronize(self, pods: Sequence[PodInfo],
                        containers: Sequence[ContainerInfo]) -> None:
            raise RuntimeError("cannot read state")

    setup = await make([BrokenSync("broken")], cfg=plugin_config(strict=True), pods=[pod()])
    assert setup.conn.alive
    failed = setup.sink.named("event_failed")
    assert failed[0]["nri_event"] == "synchronize"
    assert "cannot read state" in failed[0]["reason"]


async def test_one_canonical_log_line_per_event(make) -> None:
    stream = io.StringIO()
    LoggingSetup(LoggingConfig(format="json"), level="info", stream=stream)
    capability = Recorder("h", settings=ContainerSettings(annotations={"a": "1"}))
    setup = await make([capability])
    stream.seek(0)
    stream.truncate()
    await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    canonical = [line for line in lines if line.get("event") == "nri_event"]
    assert len(canonical) == 1
    line = canonical[0]
    assert (line["nri_event"], line["pod"], line["container"], line["result"]) == (
        "create_container", "ns/pod-uid-1", "name-c1", "ok")
    assert isinstance(line["duration_ms"], float)


async def test_strict_inline_failure_is_logged_and_counted_once(make) -> None:
    stream = io.StringIO()
    LoggingSetup(LoggingConfig(format="json"), level="info", stream=stream)
    metrics = PluginMetrics()
    bad = Recorder("bad", error=OSError("resctrl gone"), inline=True)
    setup = await make([bad], cfg=plugin_config(strict=True), metrics=metrics)
    stream.seek(0)
    stream.truncate()
    with pytest.raises(RpcError) as error:
        await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    assert "resctrl gone" in error.value.message
    await asyncio.sleep(0)  # logged and counted on the loop's next turn, after the answer
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    canonical = [line for line in lines if line.get("event") == "nri_event"]
    assert len(canonical) == 1
    assert (canonical[0]["nri_event"], canonical[0]["result"]) == ("create_container", "error")
    assert requests(metrics, "create_container", "error") == 1


class ThreadProbe(Capability):
    """Records the thread its CreateContainer handler ran on."""

    def __init__(self, name: str, *, inline: bool) -> None:
        self.name = name
        self.events = frozenset({Event.CREATE_CONTAINER})
        self.inline_events = self.events if inline else frozenset()
        self.threads: list[int] = []
        self.tasks: list[asyncio.Task[Any] | None] = []

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        self.threads.append(threading.get_ident())
        try:
            self.tasks.append(asyncio.current_task())
        except RuntimeError:  # a worker thread has no loop
            self.tasks.append(None)
        return EMPTY_SETTINGS


async def test_computing_capabilities_run_on_the_loop_blocking_ones_in_a_worker(make) -> None:
    loop_thread = threading.get_ident()
    fast_a, fast_b = ThreadProbe("a", inline=True), ThreadProbe("b", inline=True)
    setup = await make([fast_a, fast_b])
    await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    assert fast_a.threads == fast_b.threads == [loop_thread]
    # Handled, and answered, by the connection's reader itself: no task, no turn of the loop.
    assert fast_a.tasks == fast_b.tasks
    (reader,) = fast_a.tasks
    assert reader is not None
    assert reader.get_coro().__qualname__ == "TtrpcPeer.run"  # type: ignore[union-attr]

    # One capability that may block moves the whole chain, in order, to a worker thread.
    fast, slow = ThreadProbe("fast", inline=True), ThreadProbe("slow", inline=False)
    setup = await make([fast, slow])
    await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    assert fast.threads == slow.threads
    assert fast.threads[0] != loop_thread


async def assert_fails_open(setup: Setup, reason: str) -> None:
    """A CreateContainer answered with no adjustment, one audit record naming ``reason``, and
    the connection kept."""
    response = await setup.simulator.send(setup.conn, Event.CREATE_CONTAINER, pod(), container())
    assert isinstance(response, api.CreateContainerResponse)
    assert response.adjust == api.ContainerAdjustment()
    assert setup.conn.alive
    (skipped,) = setup.sink.named("adjustment_skipped")
    assert reason in skipped["reason"]


async def test_inline_capability_raising_cancelled_error_fails_open(make) -> None:
    capability = Recorder("cancels", settings=ContainerSettings(oom_score_adj=900),
                          error=asyncio.CancelledError("capability code"), inline=True)
    setup = await make([capability])
    await assert_fails_open(setup, "capability cancels failed: CancelledError")


def test_failed_create_container_answers_an_empty_payload(executor: ThreadPoolExecutor) -> None:
    huge = Recorder("huge", settings=ContainerSettings(memory_reservation=1 << 70), inline=True)
    sink = MemoryAuditSink()
    stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=Config,
                      capabilities=[huge], audit=AuditLog(sink), executor=executor,
                      state=NodeState())
    request = envelope.Request(
        service=PLUGIN_SERVICE, method="CreateContainer",
        payload=api.CreateContainerRequest(pod=pod(), container=container()).SerializeToString())

    async def handle() -> object:
        configure(stub)
        return stub.handlers[(PLUGIN_SERVICE, "CreateContainer")](request)

    # Filled in part before building the answer failed, cleared, and then not sent at all.
    assert asyncio.run(handle()) == b""
    (skipped,) = sink.named("adjustment_skipped")
    assert "ValueError" in skipped["reason"]


async def test_failure_outside_the_capabilities_fails_open_or_strict(make) -> None:
    # A value no adjustment can carry (beyond int64) breaks building the answer, not a capability.
    huge = Recorder("huge", settings=ContainerSettings(memory_reservation=1 << 70))
    setup = await make([huge])
    await assert_fails_open(setup, "ValueError")

    strict = await make([huge], cfg=plugin_config(strict=True))
    with pytest.raises(RpcError) as error:
        await strict.simulator.send(strict.conn, Event.CREATE_CONTAINER, pod(), container())
    assert error.value.code == StatusCode.UNKNOWN


@pytest.mark.parametrize("timeout_ms", [-5, 0, 10**13])
async def test_absurd_request_timeouts_mean_the_default(make, timeout_ms: int) -> None:
    setup = await make(runtime=RuntimeSpec(request_timeout_ms=2000))
    request = api.ConfigureRequest(runtime_name="containerd", runtime_version="v2.1.0",
                                   request_timeout=timeout_ms, registration_timeout=timeout_ms)
    setup.stub.handlers[(PLUGIN_SERVICE, "Configure")](envelope_request("Configure", request))
    assert setup.stub.terms.request_timeout_ms == 2000
    assert setup.stub.deadline_ms() == 1500
    assert setup.stub.handshake.registration_timeout_ms == 5000


def configure(stub: PluginStub) -> None:
    """Configure ``stub`` as a runtime would, without a connection."""
    configure_request = envelope.Request(
        service=PLUGIN_SERVICE, method="Configure",
        payload=api.ConfigureRequest(runtime_name="containerd", runtime_version="v2.1.0",
                                     NRI_version="v0.12.0").SerializeToString())
    stub.handlers[(PLUGIN_SERVICE, "Configure")](configure_request)


def envelope_request(method: str, message: Any) -> Any:
    from protos import ttrpc_envelope_pb2 as envelope

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


def requests(metrics: PluginMetrics, event: str, result: str) -> float:
    return metrics.registry.get_sample_value(
        "nri_qos_nri_requests_total", {"event": event, "result": result}) or 0.0


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
