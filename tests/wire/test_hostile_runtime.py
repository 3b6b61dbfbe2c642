"""A broken or hostile runtime cannot hurt the agent, over a real socket.

One group per way a runtime can misbehave: a Synchronize of many chunks, pods carrying megabytes,
a handshake that stalls, answers nobody reads, strings of megabytes where names belong, requests
the wire protocol refuses, and frames over the size limit. Memory is measured where it is the
point (tracemalloc here, the RSS of an ``nri-qos run`` child where the memory is the C library's).
No wait is longer than the deadline it checks: every wait is bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import os
import struct
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.model import MAX_ANNOTATION_CHARS
from nri_plugin.cli import daemon
from nri_plugin.config.schema import Config
from nri_plugin.obs.logs import LoggingConfig, LoggingSetup
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.wire.mux import MAX_MUX_PAYLOAD, PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.transport import MAX_UNSENT_BYTES, READ_SIZE, TtrpcPeer
from nri_plugin.wire.ttrpc import MAX_DATA_LENGTH, MessageType, encode_frame
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as envelope
from tests.support.raw_runtime import (
    BOUND_S,
    MiB,
    RawRuntime,
    Session,
    configure_request,
    container_message,
    create_request,
    mux_frame,
    plugin_config,
    pod_message,
    reset_peak,
    running_agent,
    socket_pair,
    status_kib,
)

SHORT_MS = 100
"""The registration timeout the tests' runtime states: the deadline of every handshake step."""
LOG_LINE_LIMIT = 4096

READ_KEYS = sorted(Config().read_keys().annotations)


Start = Callable[..., Awaitable[Session]]


@pytest.fixture
async def session(executor: ThreadPoolExecutor) -> AsyncIterator[Start]:
    """A stub serving one end of a socket pair; the test plays the runtime at the other."""
    made: list[Session] = []

    async def start(cfg: Config | None = None, *, state: NodeState | None = None,
                    audit: AuditLog | None = None) -> Session:
        current = cfg or plugin_config()
        sink = MemoryAuditSink()
        node = state or NodeState()
        stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: current,
                          capabilities=[], audit=audit or AuditLog(sink), executor=executor,
                          state=node)
        reader, writer, runtime = await socket_pair()
        made.append(Session(stub, runtime, asyncio.create_task(stub.serve(reader, writer)),
                            sink, node))
        return made[-1]

    yield start
    for made_session in made:
        made_session.stub.close()
        made_session.runtime.close()
        await made_session.serving


@pytest.fixture
def log_lines() -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """The operational log as JSON lines, from here on."""
    stream = io.StringIO()
    setup = LoggingSetup(LoggingConfig(format="json"), level="info", stream=stream)

    def lines() -> list[dict[str, Any]]:
        return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]

    yield lines
    setup.close()


def named(lines: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [line for line in lines if line.get("event") == event]


@pytest.fixture
def traced() -> Iterator[Callable[[], int]]:
    """tracemalloc on for the test; returns the traced memory now (after a collection). Logs go
    nowhere meanwhile: a log kept in memory would count."""
    devnull = open(os.devnull, "w")  # noqa: SIM115 (closed below, after the logging setup)
    setup = LoggingSetup(LoggingConfig(format="json"), level="info", stream=devnull)
    tracemalloc.start()

    def now() -> int:
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    yield now
    tracemalloc.stop()
    setup.close()
    devnull.close()


# -- 1. a Synchronize of many chunks --------------------------------------------------------------

AGENT_CONFIG = """
[plugin]
reconnect_initial_ms = 50
[reconciler]
enabled = false
[resctrl]
enabled = false
"""


async def test_split_synchronize_costs_one_chunk_of_memory_not_all_of_them(
    tmp_path: Path,
) -> None:
    # 16 chunks of 2.4 MiB: were the raw messages kept until the last chunk, the agent would
    # hold all 38 MiB of them (and convert them all at once, at the end).
    chunks, pods_per_chunk, blob = 16, 50, "b" * (48 << 10)
    async with running_agent(tmp_path, AGENT_CONFIG) as agent:
        runtime = await agent.accept()
        await runtime.register()
        assert (await runtime.call("Configure", configure_request())).ok
        before = status_kib(agent.pid, "VmRSS")
        reset_peak(agent.pid)
        for i in range(chunks):
            pods = [pod_message(f"s{i}-{j}", annotations={"unread/blob": blob})
                    for j in range(pods_per_chunk)]
            request = api.SynchronizeRequest(pods=pods, more=i < chunks - 1)
            reply = await runtime.call("Synchronize", request.SerializeToString())
            assert reply.ok
            assert api.SynchronizeResponse.FromString(reply.payload).more == (i < chunks - 1)
        growth_mib = (status_kib(agent.pid, "VmHWM") - before) / 1024
        assert await runtime.create_container_ok()
        runtime.close()
    assert growth_mib < 20, f"the agent grew by {growth_mib:.0f} MiB for a 38 MiB Synchronize"


@pytest.mark.parametrize(("limit", "listed", "refused"), [
    ("max_sync_pods", 5, False), ("max_sync_pods", 6, True),
    ("max_sync_containers", 5, False), ("max_sync_containers", 6, True),
])
async def test_synchronize_over_its_limits_is_refused_and_the_known_state_kept(
    session: Start, limit: str, listed: int, refused: bool,
) -> None:
    state = NodeState()
    first = await session(plugin_config(**{limit: 5}), state=state)
    known = [pod_message("known")]
    await first.runtime.register()
    await first.runtime.call("Configure", configure_request())
    await first.runtime.call("Synchronize", api.SynchronizeRequest(
        pods=known, containers=[container_message("known")]).SerializeToString())
    assert set(state.snapshot().pods) == {"sb-known"}

    # The runtime reconnects (it restarted) and lists more than the agent takes, in chunks.
    again = await session(plugin_config(**{limit: 5}), state=state)
    runtime = again.runtime
    await runtime.register()
    await runtime.call("Configure", configure_request())
    uids = [f"u{i}" for i in range(listed)]
    chunks = [uids[:3], uids[3:]]
    for i, chunk in enumerate(chunks):
        request = api.SynchronizeRequest(
            pods=[pod_message(uid) for uid in chunk],
            containers=[container_message(uid) for uid in chunk], more=i == 0)
        reply = await runtime.call("Synchronize", request.SerializeToString())
        # Answered as the runtime requires, refused or not: it would drop the plugin otherwise.
        assert reply.ok
        assert api.SynchronizeResponse.FromString(reply.payload).more == (i == 0)
    pods = set(state.snapshot().pods)
    failed = again.sink.named("event_failed")
    if refused:
        assert pods == {"sb-known"}
        (record,) = failed
        assert record["nri_event"] == "synchronize"
        assert f"{listed} " in record["reason"]
        assert f"plugin.{limit} = 5" in record["reason"]
        assert again.rejections() == {"synchronize_over_limit": 1}
    else:
        assert pods == {f"sb-{uid}" for uid in uids}
        assert failed == []
    # Either way the agent serves events, on what it knows.
    assert await runtime.create_container_ok("known")


@pytest.mark.parametrize("extra", [0, 1])
async def test_synchronize_byte_limit_at_its_exact_value(session: Start, extra: int) -> None:
    limit = 4 * MiB  # the smallest allowed; the chunks add up to it, or to one byte more
    last = api.SynchronizeRequest(pods=[pod_message("c")]).SerializeToString()

    def chunk(uid: str, padding: int) -> bytes:
        pod = pod_message(uid, annotations={"unread/pad": "p" * padding})
        return api.SynchronizeRequest(pods=[pod], more=True).SerializeToString()

    first = chunk("a", limit // 2)
    target = limit + extra - len(last) - len(first)
    padding = target - len(chunk("b", 0))
    while len(chunk("b", padding)) > target:
        padding -= 1
    second = chunk("b", padding)
    assert len(first) + len(second) + len(last) == limit + extra
    setup = await session(plugin_config(max_sync_bytes=limit))
    await setup.runtime.register()
    await setup.runtime.call("Configure", configure_request())
    for payload in (first, second, last):
        assert (await setup.runtime.call("Synchronize", payload)).ok
    assert set(setup.state.snapshot().pods) == (set() if extra else {"sb-a", "sb-b", "sb-c"})
    assert len(setup.sink.named("event_failed")) == extra


# -- 2. pods carrying megabytes -------------------------------------------------------------------


async def test_pods_keep_only_what_policies_read_and_give_it_back(
    session: Start, traced: Callable[[], int],
) -> None:
    setup = await session()
    runtime = setup.runtime
    await runtime.handshake()
    # 3 MiB of annotations per pod, as many labels as anyone would put on a pod.
    half = "x" * (3 * MiB // 2)
    eighth = "x" * (3 * MiB // len(READ_KEYS))
    many_labels = {f"label-{i}": "v" * 63 for i in range(128)}
    pods = [
        # One read annotation of 1.5 MiB (kept cut), as much unread, labels nothing reads.
        *(pod_message(f"fat{i}", annotations={READ_KEYS[0]: half, "unread/blob": half},
                      labels=many_labels) for i in range(10)),
        # Every annotation the agent reads, long: more than one pod may keep (refused).
        *(pod_message(f"hostile{i}", annotations=dict.fromkeys(READ_KEYS, eighth))
          for i in range(10)),
    ]
    baseline = traced()
    for pod in pods:
        await runtime.call("RunPodSandbox", api.RunPodSandboxRequest(pod=pod).SerializeToString())
        await runtime.call("CreateContainer", api.CreateContainerRequest(
            pod=pod, container=container_message(pod.uid)).SerializeToString())
    assert set(setup.state.snapshot().pods) == {f"sb-fat{i}" for i in range(10)}
    kept = traced() - baseline
    # Each fat pod keeps its one read annotation, cut to the longest value a policy accepts
    # (plus one character), and its container; nothing else.
    assert kept < 10 * (MAX_ANNOTATION_CHARS + (8 << 10)), f"{kept} bytes kept for 10 pods"
    for pod in pods:
        await runtime.call("RemovePodSandbox",
                           api.RemovePodSandboxRequest(pod=pod).SerializeToString())
    assert setup.state.snapshot().pods == {}
    left = traced() - baseline
    assert left < 64 << 10, f"{left} bytes still held after every pod went"


# -- 3. waits without an end ----------------------------------------------------------------------


async def stall_before_configure(runtime: RawRuntime) -> None:
    await runtime.register()


async def half_a_configure(runtime: RawRuntime) -> None:
    await runtime.register()
    whole = runtime.request_bytes("Configure", configure_request(SHORT_MS), runtime.stream())
    runtime.write(whole[: len(whole) // 2])


async def bare_mux_header(runtime: RawRuntime) -> None:
    await runtime.register()
    runtime.write(struct.pack(">II", PLUGIN_SERVICE_CONN, MAX_MUX_PAYLOAD))


async def stall_before_synchronize(runtime: RawRuntime) -> None:
    await runtime.register()
    await runtime.call("Configure", configure_request(SHORT_MS))


async def stall_after_a_chunk(runtime: RawRuntime) -> None:
    await stall_before_synchronize(runtime)
    await runtime.call("Synchronize", api.SynchronizeRequest(more=True).SerializeToString())


async def header_of_a_huge_frame(runtime: RawRuntime) -> None:
    await runtime.handshake(SHORT_MS)
    header = struct.pack(">IIBB", 0xFFFFFFFF, runtime.stream(), MessageType.REQUEST, 0)
    runtime.write(mux_frame(PLUGIN_SERVICE_CONN, header))


@pytest.mark.parametrize(("stall", "reason"), [
    (stall_before_configure, "handshake timeout: no Configure after RegisterPlugin"),
    (half_a_configure, "stalled: the rest of a frame"),
    (bare_mux_header, "stalled: the rest of a frame"),
    (stall_before_synchronize, "handshake timeout: no Synchronize after Configure"),
    (stall_after_a_chunk, "handshake timeout: no the next Synchronize chunk"),
    (header_of_a_huge_frame, "stalled: the rest of a frame"),
])
async def test_every_wait_on_the_runtime_ends(
    session: Start, log_lines: Callable[[], list[dict[str, Any]]],
    stall: Callable[[RawRuntime], Awaitable[None]], reason: str,
) -> None:
    setup = await session(plugin_config(register_timeout_ms=SHORT_MS))
    await stall(setup.runtime)
    ended = await setup.ended()
    assert ended.startswith(reason), ended
    assert f"{SHORT_MS} ms" in ended or "0.1 s" in ended
    stalls = named(log_lines(), "handshake_timeout") + named(log_lines(), "connection_stalled")
    assert len(stalls) == 1
    assert await setup.runtime.closed_within(BOUND_S)


@asynccontextmanager
async def daemon_connecting(directory: Path, config_text: str,
                            level: str) -> AsyncIterator[asyncio.Queue[RawRuntime]]:
    """The daemon (in this process) connecting to a socket the test listens on; the
    connections it makes, as they come."""
    socket_path = directory / "nri.sock"
    config_path = directory / "config.toml"
    config_path.write_text(config_text)
    connections: asyncio.Queue[RawRuntime] = asyncio.Queue()
    seen: list[RawRuntime] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(RawRuntime(reader, writer))
        await connections.put(seen[-1])

    server = await asyncio.start_unix_server(accepted, path=str(socket_path), limit=8 * MiB)
    stop = asyncio.Event()
    agent = asyncio.create_task(daemon.serve(str(config_path), str(socket_path), level,
                                             stop=stop, prelaunched=None))
    try:
        yield connections
    finally:
        stop.set()
        assert await agent == 0
        server.close()
        await server.wait_closed()
        for runtime in seen:
            runtime.close()


async def test_a_stalled_handshake_is_dropped_and_the_agent_connects_again(
    tmp_path: Path,
) -> None:
    config_text = f"""
[plugin]
register_timeout_ms = {SHORT_MS}
reconnect_initial_ms = 20
[resctrl]
enabled = false
[reconciler]
enabled = false
"""
    async with daemon_connecting(tmp_path, config_text, "warning") as connections:
        async with asyncio.timeout(BOUND_S):
            first = await connections.get()
        await first.register()  # and then nothing: no Configure ever comes
        assert await first.closed_within(BOUND_S)
        async with asyncio.timeout(BOUND_S):
            second = await connections.get()
        await second.handshake(SHORT_MS)
        assert await second.create_container_ok()


async def test_a_configure_that_does_not_decode_ends_the_session(
    session: Start, log_lines: Callable[[], list[dict[str, Any]]],
) -> None:
    setup = await session()
    runtime = setup.runtime
    await runtime.register()
    # The garbage Configure and a CreateContainer arrive together, in one read.
    configure = runtime.stream()
    create = runtime.stream()
    runtime.write(runtime.request_bytes("Configure", b"\xff\xff\xff\xff", configure)
                  + runtime.request_bytes("CreateContainer", create_request("x"), create))
    reply = await runtime.answer(configure)
    assert reply.code == StatusCode.INVALID_ARGUMENT
    # Not served as if configured: refused, or never answered because the session ended.
    try:
        served = await runtime.answer(create)
    except (EOFError, OSError):
        pass
    else:
        assert served.code == StatusCode.FAILED_PRECONDITION
    assert "Configure payload does not decode" in await setup.ended()
    assert named(log_lines(), "configured") == []
    assert not setup.stub.handshake.configured


async def test_events_before_configure_are_refused(session: Start) -> None:
    setup = await session()
    await setup.runtime.register()
    reply = await setup.runtime.call("CreateContainer", create_request("early"))
    assert reply.code == StatusCode.FAILED_PRECONDITION
    assert setup.rejections() == {"out_of_order": 1}
    await setup.runtime.call("Configure", configure_request())
    await setup.runtime.call("Synchronize", b"")
    assert await setup.runtime.create_container_ok()


# -- 4. answers nobody reads ----------------------------------------------------------------------


def echo_now(request: envelope.Request) -> bytes:
    return request.payload


async def flood_without_reading(runtime: RawRuntime, requests: int) -> int:
    """Write requests (1 KiB, echoed) until the agent stops taking them (the socket fills up);
    how many went."""
    sent = 0
    payload = b"p" * 1024
    while sent < requests:
        runtime.write(b"".join(runtime.request_bytes("EchoNow", payload, runtime.stream(),
                                                     service="test.Echo")
                               for _ in range(100)))
        sent += 100
        try:
            await runtime.flush(0.5)
        except (TimeoutError, OSError):  # blocked, or dropped already
            break
    return sent


async def test_a_runtime_that_stops_reading_stops_being_read(traced: Callable[[], int]) -> None:
    # The runtime's own stream buffers no more than asyncio's default (it "does not read").
    reader, writer, runtime = await socket_pair(limit=64 << 10)
    peer = TtrpcPeer(reader, writer, serve_conn=1, call_conn=2,
                     handlers={("test.Echo", "EchoNow"): echo_now})
    running = asyncio.create_task(peer.run())
    try:
        baseline = traced()
        tracemalloc.reset_peak()
        # 20,000 answers of 1 KiB would be 20 MiB queued in the agent without backpressure.
        sent = await flood_without_reading(runtime, 20_000)
        assert sent < 20_000, "the agent kept reading while nobody took its answers"
        # At most the limit, and the answers to the one read that crossed it.
        unsent = writer.transport.get_write_buffer_size()
        assert unsent <= MAX_UNSENT_BYTES + READ_SIZE
        peak = tracemalloc.get_traced_memory()[1] - baseline
        assert peak < 4 << 20, f"peak of {peak} bytes while the runtime did not read"
        # Nothing is lost: once the runtime reads again, every request is answered, in order.
        last = runtime.next_stream - 2
        reply = await runtime.answer(last, seconds=30)
        assert reply.payload == b"p" * 1024
        assert not peer.closed
    finally:
        peer.close()
        runtime.close()
        await running


async def test_a_runtime_that_never_reads_again_is_dropped() -> None:
    reader, writer, runtime = await socket_pair(limit=64 << 10)
    peer = TtrpcPeer(reader, writer, serve_conn=1, call_conn=2,
                     handlers={("test.Echo", "EchoNow"): echo_now}, stall_timeout_s=0.1)
    running = asyncio.create_task(peer.run())
    try:
        await flood_without_reading(runtime, 20_000)
        async with asyncio.timeout(BOUND_S):
            await running
        assert peer.end_reason.startswith("stalled:")
        assert "answers not taken" in peer.end_reason
    finally:
        peer.close()
        runtime.close()
        await running


# -- 5. strings of megabytes ----------------------------------------------------------------------


async def test_runtime_strings_never_reach_a_log_line_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    config_text = """
[plugin]
reconnect_initial_ms = 20
[resctrl]
enabled = false
[reconciler]
enabled = false
"""
    error = "E" * 100_000
    long_name = "n" * 1024  # as long as names may be: kept, but not logged whole
    async with daemon_connecting(tmp_path, config_text, "info") as connections:
        async with asyncio.timeout(BOUND_S):
            first = await connections.get()
        await first.register(error=error)
        assert await first.closed_within(BOUND_S)
        async with asyncio.timeout(BOUND_S):
            runtime = await connections.get()
        await runtime.register()
        huge = "r" * (MAX_DATA_LENGTH - 4096)
        assert (await runtime.call("Configure", configure_request(runtime_name=huge))).ok
        assert (await runtime.call("Synchronize", b"")).ok
        refused = pod_message("huge", name="p" * (MAX_DATA_LENGTH - 8192))
        kept = api.PodSandbox(id="sb-long", uid="u" * 256, name=long_name,
                              namespace=long_name,
                              annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
        container = api.Container(id="c-long", pod_sandbox_id="sb-long", name=long_name)
        for pod in (refused, kept):
            await runtime.call("RunPodSandbox",
                               api.RunPodSandboxRequest(pod=pod).SerializeToString())
            await runtime.call("CreateContainer", api.CreateContainerRequest(
                pod=pod, container=container).SerializeToString())
    lines = capsys.readouterr().err.splitlines()
    assert max(len(line.encode()) for line in lines) <= LOG_LINE_LIMIT
    # The runtime's 100 KB refusal is quoted (bounded) once, not once more as the reason.
    assert sum(error[:100] in line for line in lines) == 1
    events = [json.loads(line) for line in lines if '"nri_event"' in line]
    assert any(line.get("audit") for line in events), "the long-named pod was served"


# -- 6. refusals are loud, once ------------------------------------------------------------------


async def test_every_refusal_is_logged_once_per_kind_and_counted(
    session: Start, log_lines: Callable[[], list[dict[str, Any]]],
) -> None:
    setup = await session()
    runtime = setup.runtime
    await runtime.handshake()
    expected = {
        "bad_stream_id": StatusCode.INVALID_ARGUMENT,
        "unknown_service": StatusCode.UNIMPLEMENTED,
        "unknown_method": StatusCode.UNIMPLEMENTED,
        "bad_envelope": StatusCode.INVALID_ARGUMENT,
        "bad_payload": StatusCode.OK,  # fail-open: an empty answer
    }
    for _ in range(3):
        answers = {}
        runtime.write(runtime.request_bytes("CreateContainer", b"", 2))  # even
        answers["bad_stream_id"] = 2
        answers["unknown_service"] = runtime.send("CreateContainer", b"", service="no.Such")
        answers["unknown_method"] = runtime.send("NoSuchMethod", b"")
        bad = runtime.stream()
        runtime.write(mux_frame(PLUGIN_SERVICE_CONN, encode_frame(
            bad, MessageType.REQUEST, b"\xff\xff\xff")))
        answers["bad_envelope"] = bad
        answers["bad_payload"] = runtime.send("CreateContainer", b"\xff\xff garbage")
        runtime.write(mux_frame(9, b"for a connection nobody opened"))
        runtime.write(mux_frame(PLUGIN_SERVICE_CONN, encode_frame(runtime.stream(), 0x7E, b"?")))
        runtime.write(mux_frame(RUNTIME_SERVICE_CONN, encode_frame(
            99, MessageType.RESPONSE, b"")))
        for kind, stream_id in answers.items():
            assert (await runtime.answer(stream_id)).code == expected[kind], kind
    assert await runtime.create_container_ok()
    kinds = {*expected, "unknown_connection", "unknown_frame_type", "stray_response"}
    warnings = named(log_lines(), "nri_rejected")
    assert sorted(line["kind"] for line in warnings) == sorted(kinds)
    assert all(line["level"] == "warning" for line in warnings)
    assert setup.rejections() == dict.fromkeys(kinds, 3)
    setup.stub.close()
    await setup.ended()
    (summary,) = named(log_lines(), "nri_rejections")
    assert summary["counts"] == dict.fromkeys(kinds, 3)


# -- 7. frames over the size limit ---------------------------------------------------------------


async def test_an_oversized_frame_is_answered_and_the_connection_kept(
    session: Start, traced: Callable[[], int],
) -> None:
    setup = await session()
    runtime = setup.runtime
    await runtime.handshake()
    stream_id = runtime.stream()
    length = MAX_DATA_LENGTH + 1
    message = struct.pack(">IIBB", length, stream_id, MessageType.REQUEST, 0) + bytes(length)
    baseline = traced()
    tracemalloc.reset_peak()
    # As a Go runtime writes it: 4096 bytes, then the rest, here in 64 KiB writes.
    runtime.write(mux_frame(PLUGIN_SERVICE_CONN, message[:4096]))
    rest = memoryview(message)[4096:]
    runtime.write(struct.pack(">II", PLUGIN_SERVICE_CONN, len(rest)))
    for i in range(0, len(rest), 64 << 10):
        runtime.write(rest[i : i + (64 << 10)])
        await runtime.flush()
    reply = await runtime.answer(stream_id)
    peak = tracemalloc.get_traced_memory()[1] - baseline
    assert reply.code == StatusCode.RESOURCE_EXHAUSTED
    assert reply.message == f"message length {length} exceed maximum message size of 4194304"
    # Skipped as it arrived, never held whole.
    assert peak < 2 * MiB, f"peak of {peak} bytes for a {length}-byte frame"
    assert await runtime.create_container_ok()
    assert not setup.serving.done()
    assert setup.rejections() == {"oversized_frame": 1}
