"""The plugin stub's deadlines and failures against the runtime simulator over a real unix socket:
slow, failing and hanging capabilities, fail-open or strict, and what is logged and counted."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.metrics import PluginMetrics
from common.state import NodeState
from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo
from hooks.settings import EMPTY_SETTINGS, ContainerSettings
from nri_plugin.config.schema import Config
from nri_plugin.obs.logs import LoggingConfig, LoggingSetup
from nri_plugin.session.capability import Capability, ContainerEvent
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.scenario import RuntimeSpec
from nri_plugin.wire.errors import RpcError
from nri_plugin.wire.nri_api import PLUGIN_SERVICE
from nri_plugin.wire.status import StatusCode
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as envelope
from tests.support.raw_runtime import plugin_config
from tests.support.stub_runtime import Recorder, Setup, configure, container, pod, requests


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
