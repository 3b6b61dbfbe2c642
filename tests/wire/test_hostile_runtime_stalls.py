"""A runtime that stalls or stops reading cannot hurt the agent, over a real socket.

A handshake that stalls, waits on the runtime that must all end, a Configure that does not decode,
events before Configure, and answers nobody reads. No wait is longer than the deadline it checks:
every wait is bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import struct
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from nri_plugin.wire.mux import MAX_MUX_PAYLOAD, PLUGIN_SERVICE_CONN
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.transport import MAX_UNSENT_BYTES, READ_SIZE, TtrpcPeer
from nri_plugin.wire.ttrpc import MessageType
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as envelope
from tests.support.hostile_runtime import Start, daemon_connecting, named
from tests.support.raw_runtime import (
    BOUND_S,
    RawRuntime,
    configure_request,
    create_request,
    mux_frame,
    plugin_config,
    socket_pair,
)

SHORT_MS = 100
"""The registration timeout the tests' runtime states: the deadline of every handshake step."""


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


@pytest.mark.parametrize("after_a_good_one", [False, True])
async def test_a_configure_that_does_not_decode_ends_the_session(
    session: Start, log_lines: Callable[[], list[dict[str, Any]]], after_a_good_one: bool,
) -> None:
    """After a good Configure too: what is read with the garbage one is not served with the
    terms of the first."""
    setup = await session()
    runtime = setup.runtime
    await runtime.register()
    if after_a_good_one:
        await runtime.call("Configure", configure_request(SHORT_MS))
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
    assert len(named(log_lines(), "configured")) == after_a_good_one
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
