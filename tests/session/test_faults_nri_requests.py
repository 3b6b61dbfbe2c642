"""Faults on the runtime's side of the NRI connection, each with the outcome the agent promises.

The runtime goes away in the middle of a request, never answers RegisterPlugin, configures the
plugin before that answer, or waits on a capability that hangs. Every case runs over a real unix
socket against the stub (or ``run_external``, the daemon's connection loop); waits are bounded by
the deadline they check.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo
from hooks.settings import ContainerSettings
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability, ContainerEvent, PodEvent
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.scenario import RuntimeSpec
from nri_plugin.sim.simulator import RuntimeSimulator
from nri_plugin.wire.envelope import decode_request, encode_response
from nri_plugin.wire.errors import ConnectionClosed
from nri_plugin.wire.mux import RUNTIME_SERVICE_CONN, encode_message
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.ttrpc import MessageType, encode_frame
from protos import nri_api_pb2 as api
from tests.support.nri_faults import Quick
from tests.support.raw_runtime import (
    BOUND_S,
    Session,
    configure_request,
    container_message,
    create_request,
    plugin_config,
    pod_message,
    socket_pair,
)

SHORT_MS = 100
"""Registration timeout of the tests' runtimes and plugins: the deadline of a handshake step."""


class Hanging(Capability):
    """A capability that blocks in its worker thread until released (as one stuck on a kernel
    file would), at RunPodSandbox and CreateContainer; ``entered`` is set once it blocks."""

    name = "hanging"
    events = frozenset({Event.RUN_POD_SANDBOX, Event.CREATE_CONTAINER})

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    def _hang(self) -> None:
        self.entered.set()
        self.release.wait(10)
        self.returned.set()

    def run_pod_sandbox(self, event: PodEvent) -> None:
        self._hang()

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        self._hang()
        return ContainerSettings(annotations={"hanging": "late"})


Start = Callable[..., Any]


@pytest.fixture
async def session(executor: ThreadPoolExecutor) -> AsyncIterator[Start]:
    """A stub serving one end of a socket pair; the test plays the runtime at the other. Each
    call is a new connection of the same stub (as after a reconnect)."""
    made: list[Session] = []
    stubs: dict[int, tuple[PluginStub, MemoryAuditSink, NodeState]] = {}

    async def start(capabilities: Sequence[Capability] = (), cfg: Config | None = None, *,
                    stub: PluginStub | None = None) -> Session:
        if stub is None:
            current = cfg or plugin_config()
            sink, state = MemoryAuditSink(), NodeState()
            stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: current,
                              capabilities=capabilities, audit=AuditLog(sink),
                              executor=executor, state=state)
            stubs[id(stub)] = (stub, sink, state)
        stub, sink, state = stubs[id(stub)]
        reader, writer, runtime = await socket_pair()
        made.append(Session(stub, runtime, asyncio.create_task(stub.serve(reader, writer)),
                            sink, state))
        return made[-1]

    yield start
    for stub, _, _ in stubs.values():
        stub.close()
    for made_session in made:
        made_session.runtime.close()
        await made_session.serving


# -- the runtime goes away in the middle of a request ---------------------------------------------


async def test_a_runtime_gone_mid_request_ends_the_session_and_the_late_answer_is_dropped(
    session: Start,
) -> None:
    capability = Hanging()
    setup = await session([capability])
    await setup.runtime.handshake()
    pod = pod_message("mid")
    setup.runtime.send("RunPodSandbox", api.RunPodSandboxRequest(pod=pod).SerializeToString())
    assert await asyncio.to_thread(capability.entered.wait, BOUND_S)
    setup.runtime.close()  # containerd dies while the plugin works on its request
    assert await setup.ended() == "connection closed by peer"
    assert not setup.stub.connected
    assert setup.stub.connection_state == "disconnected"
    # The capability's work ends later, in its thread; its result goes nowhere (no task waits for
    # it, nothing is raised: the conftest guard fails a test that leaves a task behind).
    capability.release.set()
    assert await asyncio.to_thread(capability.returned.wait, BOUND_S)
    # The pod was taken into the node state as the request arrived; the next Synchronize (after
    # the reconnect) decides whether it is still there.
    assert set(setup.state.snapshot().pods) == {"sb-mid"}

    again = await session(stub=setup.stub)
    await again.runtime.register()
    await again.runtime.call("Configure", configure_request())
    await again.runtime.call("Synchronize", b"")
    assert setup.state.snapshot().pods == {}
    assert await again.runtime.create_container_ok("after")


async def test_a_runtime_gone_halfway_through_a_frame_ends_the_session(session: Start) -> None:
    setup = await session()
    await setup.runtime.handshake()
    whole = setup.runtime.request_bytes("CreateContainer", create_request("half"),
                                        setup.runtime.stream())
    setup.runtime.write(whole[: len(whole) // 2])
    await setup.runtime.flush()
    setup.runtime.close()
    assert await setup.ended() == "connection closed by peer"
    # Nothing of the half request was served.
    assert setup.state.snapshot().pods == {}


async def test_an_update_in_flight_when_the_runtime_goes_fails_with_connection_closed(
    session: Start,
) -> None:
    setup = await session()
    await setup.runtime.handshake()
    update = asyncio.create_task(setup.stub.update_containers(
        [api.ContainerUpdate(container_id="c1")], timeout_s=BOUND_S))
    # The runtime reads the call, then dies without answering it.
    conn, frame = await setup.runtime.frame()
    assert (conn, decode_request(frame.data).method) == (RUNTIME_SERVICE_CONN, "UpdateContainers")
    setup.runtime.close()
    with pytest.raises(ConnectionClosed, match="connection closed by peer"):
        async with asyncio.timeout(BOUND_S):
            await update
    await setup.ended()


# -- RegisterPlugin never answered, or answered after Configure ----------------------------------


async def test_a_runtime_that_never_answers_register_plugin_is_left(session: Start) -> None:
    setup = await session(cfg=plugin_config(register_timeout_ms=SHORT_MS))
    _conn, frame = await setup.runtime.frame()
    assert decode_request(frame.data).method == "RegisterPlugin"
    # ... and nothing more: not an answer, not a Configure.
    reason = await setup.ended()
    assert reason.startswith("registration failed with code 4"), reason
    assert setup.stub.rejections.as_dict()["handshake_timeout"] == 0
    assert await setup.runtime.closed_within(BOUND_S)


async def test_a_configured_session_whose_registration_is_never_answered_is_left(
    session: Start,
) -> None:
    # Configure and Synchronize come, but the answer to RegisterPlugin never does: the runtime
    # is not following its own protocol, and the plugin cannot know it is registered. It serves
    # meanwhile, then leaves at its registration timeout (and connects again).
    setup = await session(cfg=plugin_config(register_timeout_ms=SHORT_MS))
    await setup.runtime.frame()  # RegisterPlugin, kept unanswered
    assert (await setup.runtime.call("Configure", configure_request())).ok
    assert (await setup.runtime.call("Synchronize", b"")).ok
    assert await setup.runtime.create_container_ok()
    assert (await setup.ended()).startswith("registration failed with code 4")


async def test_configure_before_the_register_plugin_answer_is_served(session: Start) -> None:
    capability = Quick()
    setup = await session([capability], cfg=plugin_config(register_timeout_ms=SHORT_MS))
    runtime = setup.runtime
    conn, frame = await runtime.frame()
    assert (conn, decode_request(frame.data).method) == (RUNTIME_SERVICE_CONN, "RegisterPlugin")
    # As containerd may: Configure and Synchronize on their way before the RegisterPlugin answer.
    configure = await runtime.call("Configure", configure_request(SHORT_MS))
    assert configure.ok
    assert api.ConfigureResponse.FromString(configure.payload).events != 0
    assert (await runtime.call("Synchronize", b"")).ok
    runtime.write(encode_message(RUNTIME_SERVICE_CONN, encode_frame(
        frame.stream_id, MessageType.RESPONSE, encode_response())))
    await runtime.flush()
    # Registered and synchronized: no handshake step is owed, so no deadline ends the session
    # (waiting three registration timeouts proves it).
    await asyncio.sleep(3 * SHORT_MS / 1000)
    assert setup.stub.connected
    reply = await runtime.call("CreateContainer", create_request("early"))
    assert reply.ok
    answer = api.CreateContainerResponse.FromString(reply.payload)
    assert dict(answer.adjust.annotations) == {"quick": "yes"}
    assert setup.stub.rejections.as_dict()["handshake_timeout"] == 0
    assert setup.stub.connection_state == "synchronized"


class SlowSynchronize(Capability):
    """Takes three registration timeouts over Synchronize (a large node's state on a slow /sys),
    well within the runtime's request timeout."""

    name = "slow-synchronize"
    events = frozenset({Event.RUN_POD_SANDBOX})

    def synchronize(self, pods: Sequence[PodInfo], containers: Sequence[ContainerInfo]) -> None:
        time.sleep(3 * SHORT_MS / 1000)


async def test_a_synchronize_the_plugin_still_works_on_is_no_handshake_timeout(
    session: Start,
) -> None:
    # Each handshake deadline is for the runtime's next step. While the plugin works on the
    # Synchronize the runtime sent, the runtime waits on the plugin (under its request timeout).
    setup = await session([SlowSynchronize()], cfg=plugin_config(register_timeout_ms=SHORT_MS))
    runtime = setup.runtime
    await runtime.register()
    assert (await runtime.call("Configure", configure_request(SHORT_MS))).ok
    for more in (True, False):
        chunk = api.SynchronizeRequest(pods=[pod_message(f"more-{more}")], more=more)
        reply = await runtime.call("Synchronize", chunk.SerializeToString())
        assert reply.ok
    assert setup.stub.connection_state == "synchronized"
    assert setup.stub.rejections.as_dict()["handshake_timeout"] == 0
    assert await runtime.create_container_ok()


# -- a capability that hangs ----------------------------------------------------------------------


async def test_hung_capabilities_in_every_worker_still_answer_before_the_runtime_times_out(
    tmp_path: Path, executor: ThreadPoolExecutor,
) -> None:
    # The configured deadline (2 s) is longer than the runtime's request timeout: the stub keeps
    # its own below the runtime's, and a capability that never returns costs only its own part.
    # The simulated runtime drops a plugin that answers late, as containerd does.
    capabilities = [Hanging(), Quick()]
    runtime_timeout_ms = 400
    cfg = plugin_config(deadline_ms=2000)
    margin = cfg.plugin.deadline_margin_ms
    simulator = RuntimeSimulator(tmp_path / "nri.sock",
                                 RuntimeSpec(request_timeout_ms=runtime_timeout_ms))
    await simulator.start()
    sink = MemoryAuditSink()
    stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: cfg,
                      capabilities=capabilities, audit=AuditLog(sink), executor=executor,
                      state=NodeState())
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "nri.sock"))
    serving = asyncio.create_task(stub.serve(reader, writer))
    try:
        connection = await simulator.wait_ready()
        assert stub.deadline_ms() == runtime_timeout_ms - margin
        # More requests than worker threads: each one after the fourth finds every worker hung.
        for i in range(6):
            response = await simulator.send(connection, Event.CREATE_CONTAINER,
                                            pod_message(f"h{i}"), container_message(f"h{i}"))
            assert isinstance(response, api.CreateContainerResponse)
            # Fail-open: the hung capability's part is missing; the answer came in time.
            assert dict(response.adjust.annotations) == {}
            assert connection.alive
        skipped = sink.named("adjustment_skipped")
        assert len(skipped) == 6
        assert all("deadline" in r["reason"] and "hanging" in r["reason"] for r in skipped)
    finally:
        capabilities[0].release.set()  # type: ignore[attr-defined]
        stub.close()
        await serving
        await simulator.stop()


async def test_a_capability_that_hangs_in_strict_mode_answers_an_error_in_time(
    session: Start,
) -> None:
    capability = Hanging()
    setup = await session([capability], cfg=plugin_config(strict=True, deadline_ms=100))
    await setup.runtime.handshake()
    try:
        reply = await setup.runtime.call("CreateContainer", create_request("strict"),
                                         seconds=1.0)
        assert reply.code == StatusCode.DEADLINE_EXCEEDED
        assert "hanging" in reply.message
        assert setup.stub.connected
    finally:
        capability.release.set()
