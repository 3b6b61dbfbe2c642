"""The asyncio ttrpc peer over a real socketpair: serving, calling, limits and failures."""

from __future__ import annotations

import asyncio
import socket
import struct
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nri_plugin.wire.envelope import (
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from nri_plugin.wire.errors import ConnectionClosed, RpcError
from nri_plugin.wire.mux import MuxDecoder, encode_message
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.transport import Handler, TtrpcPeer
from nri_plugin.wire.ttrpc import MAX_DATA_LENGTH, Frame, FrameDecoder, MessageType, encode_frame
from protos import ttrpc_envelope_pb2 as envelope

T = TypeVar("T")

SERVICE = "test.Echo"
WAIT_S = 5.0
"""Bound of every wait on the other end: a framing bug fails the test in seconds, never hangs
it."""


async def within(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, WAIT_S)


async def echo(request: envelope.Request) -> bytes:
    return request.payload


async def fail(request: envelope.Request) -> bytes:
    raise ValueError("boom")


async def refuse(request: envelope.Request) -> bytes:
    raise RpcError(StatusCode.PERMISSION_DENIED, "no")


async def huge(request: envelope.Request) -> bytes:
    return b"x" * (MAX_DATA_LENGTH + 1)


async def unencodable(request: envelope.Request) -> bytes:
    # A status text with a lone surrogate cannot be encoded as a protobuf string.
    raise RpcError(StatusCode.UNKNOWN, "bad \udcff text")


def echo_now(request: envelope.Request) -> bytes:
    return request.payload.upper()


def fail_now(request: envelope.Request) -> bytes:
    raise KeyError("gone")


def refuse_now(request: envelope.Request) -> bytes:
    raise RpcError(StatusCode.FAILED_PRECONDITION, "not now")


def cancel_now(request: envelope.Request) -> bytes:
    raise asyncio.CancelledError("from the handler's own code")


async def await_cancelled(request: envelope.Request) -> bytes:
    # Work another task cancelled: awaiting it raises CancelledError in this handler's task,
    # which itself was not cancelled.
    work: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    work.cancel()
    return await work


HANDLERS: Mapping[tuple[str, str], Handler] = {
    (SERVICE, "EchoNow"): echo_now,
    (SERVICE, "FailNow"): fail_now,
    (SERVICE, "RefuseNow"): refuse_now,
    (SERVICE, "CancelNow"): cancel_now,
    (SERVICE, "AwaitCancelled"): await_cancelled,
    (SERVICE, "Echo"): echo,
    (SERVICE, "Fail"): fail,
    (SERVICE, "Refuse"): refuse,
    (SERVICE, "Huge"): huge,
    (SERVICE, "Unencodable"): unencodable,
}


async def open_pair() -> tuple[asyncio.StreamReader, asyncio.StreamWriter,
                               asyncio.StreamReader, asyncio.StreamWriter]:
    a, b = socket.socketpair()
    ra, wa = await asyncio.open_unix_connection(sock=a)
    rb, wb = await asyncio.open_unix_connection(sock=b)
    return ra, wa, rb, wb


class Peers:
    """Server side serves conn 1 and calls conn 2; client side the other way round."""

    def __init__(self, server: TtrpcPeer, client: TtrpcPeer) -> None:
        self.server = server
        self.client = client
        self.tasks = [asyncio.create_task(server.run()), asyncio.create_task(client.run())]


@pytest.fixture
async def peers() -> AsyncIterator[Peers]:
    ra, wa, rb, wb = await open_pair()
    server = TtrpcPeer(ra, wa, serve_conn=1, call_conn=2, handlers=HANDLERS)
    client = TtrpcPeer(rb, wb, serve_conn=2, call_conn=1, handlers={})
    pair = Peers(server, client)
    yield pair
    server.close()
    client.close()
    await within(asyncio.gather(*pair.tasks))


class RawPeer:
    """The other end of a socket, spoken to frame by frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.mux = MuxDecoder()
        self.decoders = {1: FrameDecoder(), 2: FrameDecoder()}
        self.mux_sizes: list[int] = []
        self.frames: list[tuple[int, Frame]] = []

    async def send(self, conn: int, stream_id: int, msg_type: int, data: bytes) -> None:
        self.writer.write(encode_message(conn, encode_frame(stream_id, msg_type, data)))
        await self.writer.drain()

    async def next_frame(self) -> tuple[int, Frame]:
        while not self.frames:
            data = await within(self.reader.read(1 << 20))
            if not data:
                raise EOFError
            for conn, payload in self.mux.feed(data):
                self.mux_sizes.append(len(payload))
                self.frames += [(conn, f) for f in self.decoders[conn].feed(payload)]
        return self.frames.pop(0)


@pytest.fixture
async def served() -> AsyncIterator[tuple[TtrpcPeer, RawPeer]]:
    ra, wa, rb, wb = await open_pair()
    peer = TtrpcPeer(ra, wa, serve_conn=1, call_conn=2, handlers=HANDLERS)
    task = asyncio.create_task(peer.run())
    yield peer, RawPeer(rb, wb)
    peer.close()
    wb.close()
    await within(task)


async def test_call_round_trip(peers: Peers) -> None:
    assert await peers.client.call(SERVICE, "Echo", b"hello", timeout_s=5) == b"hello"


async def test_unknown_method_and_service_are_unimplemented(peers: Peers) -> None:
    with pytest.raises(RpcError) as method:
        await peers.client.call(SERVICE, "Nope", b"", timeout_s=5)
    assert (method.value.code, method.value.message) == (StatusCode.UNIMPLEMENTED, "method Nope")
    with pytest.raises(RpcError) as service:
        await peers.client.call("other.Service", "Echo", b"", timeout_s=5)
    assert service.value.message == "service other.Service"


async def test_handler_exception_becomes_status(peers: Peers) -> None:
    with pytest.raises(RpcError) as failed:
        await peers.client.call(SERVICE, "Fail", b"", timeout_s=5)
    assert failed.value.code == StatusCode.UNKNOWN
    assert "boom" in failed.value.message
    with pytest.raises(RpcError) as refused:
        await peers.client.call(SERVICE, "Refuse", b"", timeout_s=5)
    assert (refused.value.code, refused.value.message) == (StatusCode.PERMISSION_DENIED, "no")
    # An answer that cannot be encoded is still answered.
    with pytest.raises(RpcError) as garbled:
        await peers.client.call(SERVICE, "Unencodable", b"", timeout_s=5)
    assert garbled.value.code == StatusCode.INTERNAL
    # The connection survives all three.
    assert await peers.client.call(SERVICE, "Echo", b"still", timeout_s=5) == b"still"


async def test_handlers_answering_at_once(peers: Peers) -> None:
    assert await peers.client.call(SERVICE, "EchoNow", b"now", timeout_s=5) == b"NOW"
    with pytest.raises(RpcError) as failed:
        await peers.client.call(SERVICE, "FailNow", b"", timeout_s=5)
    assert (failed.value.code, failed.value.message) == (StatusCode.UNKNOWN, "KeyError: 'gone'")
    with pytest.raises(RpcError) as refused:
        await peers.client.call(SERVICE, "RefuseNow", b"", timeout_s=5)
    assert (refused.value.code, refused.value.message) == (
        StatusCode.FAILED_PRECONDITION, "not now")
    # Not the reader's own cancellation: answered, and the connection stays.
    with pytest.raises(RpcError) as cancelled:
        await peers.client.call(SERVICE, "CancelNow", b"", timeout_s=5)
    assert cancelled.value.code == StatusCode.UNKNOWN
    assert "CancelledError" in cancelled.value.message
    assert await peers.client.call(SERVICE, "EchoNow", b"still", timeout_s=5) == b"STILL"


async def test_a_waiting_handler_that_raises_cancelled_error_is_answered(peers: Peers) -> None:
    # Not its task's cancellation (that only comes when the connection ends): the runtime gets
    # an answer at once instead of waiting out its request timeout and dropping the plugin.
    with pytest.raises(RpcError) as cancelled:
        await peers.client.call(SERVICE, "AwaitCancelled", b"", timeout_s=WAIT_S)
    assert cancelled.value.code == StatusCode.UNKNOWN
    assert "CancelledError" in cancelled.value.message
    assert await peers.client.call(SERVICE, "Echo", b"still", timeout_s=WAIT_S) == b"still"


async def test_only_handlers_that_wait_get_a_task() -> None:
    ra, wa, rb, wb = await open_pair()
    seen: dict[str, asyncio.Task[object] | None] = {}

    def at_once(request: envelope.Request) -> bytes:
        seen["at_once"] = asyncio.current_task()
        return b"1"

    async def waits(request: envelope.Request) -> bytes:
        await asyncio.sleep(0)
        seen["waits"] = asyncio.current_task()
        return b"2"

    server = TtrpcPeer(ra, wa, serve_conn=1, call_conn=2,
                       handlers={(SERVICE, "AtOnce"): at_once, (SERVICE, "Waits"): waits})
    client = TtrpcPeer(rb, wb, serve_conn=2, call_conn=1, handlers={})
    pair = Peers(server, client)
    try:
        assert await client.call(SERVICE, "AtOnce", b"", timeout_s=5) == b"1"
        assert await client.call(SERVICE, "Waits", b"", timeout_s=5) == b"2"
    finally:
        server.close()
        client.close()
        await within(asyncio.gather(*pair.tasks))
    # Answered from the reader itself, in the turn of the loop that read the request.
    assert seen["at_once"] is pair.tasks[0]
    assert seen["waits"] not in (None, pair.tasks[0])


async def test_many_calls_in_flight_answered_out_of_order() -> None:
    ra, wa, rb, wb = await open_pair()
    release: dict[bytes, asyncio.Event] = {}
    started: list[bytes] = []
    all_started = asyncio.Event()

    async def wait_for_release(request: envelope.Request) -> bytes:
        started.append(request.payload)
        if len(started) == len(release):
            all_started.set()
        await release[request.payload].wait()
        return request.payload

    server = TtrpcPeer(ra, wa, serve_conn=1, call_conn=2,
                       handlers={(SERVICE, "Wait"): wait_for_release})
    client = TtrpcPeer(rb, wb, serve_conn=2, call_conn=1, handlers={})
    tasks = [asyncio.create_task(server.run()), asyncio.create_task(client.run())]
    keys = [str(i).encode() for i in range(32)]
    for key in keys:
        release[key] = asyncio.Event()
    calls = [asyncio.create_task(client.call(SERVICE, "Wait", key, timeout_s=WAIT_S))
             for key in keys]
    await within(all_started.wait())
    assert client.pending_calls == len(keys)
    for key in reversed(keys):
        release[key].set()
    assert await within(asyncio.gather(*calls)) == keys
    server.close()
    client.close()
    await within(asyncio.gather(*tasks))


async def test_client_stream_ids_are_odd_increasing_with_timeout(
    served: tuple[TtrpcPeer, RawPeer],
) -> None:
    peer, raw = served
    calls = [asyncio.create_task(peer.call("rt.Runtime", "M", b"", timeout_s=3)) for _ in range(3)]
    seen = []
    for _ in range(3):
        conn, frame = await raw.next_frame()
        assert conn == 2
        assert frame.type == MessageType.REQUEST
        request = decode_request(frame.data)
        assert 0 < request.timeout_nano <= 3_000_000_000
        seen.append(frame.stream_id)
        await raw.send(2, frame.stream_id, MessageType.RESPONSE, encode_response(b"ok"))
    assert seen == [1, 3, 5]
    assert await within(asyncio.gather(*calls)) == [b"ok"] * 3


async def test_response_for_unknown_stream_is_dropped(served: tuple[TtrpcPeer, RawPeer]) -> None:
    peer, raw = served
    call = asyncio.create_task(peer.call("rt.Runtime", "M", b"", timeout_s=3))
    _, frame = await raw.next_frame()
    await raw.send(2, 99, MessageType.RESPONSE, encode_response(b"stray"))
    await raw.send(2, frame.stream_id, MessageType.RESPONSE, encode_response(b"mine"))
    assert await within(call) == b"mine"
    assert not peer.closed


async def test_server_rejects_even_and_reused_stream_ids(served: tuple[TtrpcPeer, RawPeer]) -> None:
    _, raw = served
    request = encode_request(SERVICE, "Echo", b"x")
    await raw.send(1, 2, MessageType.REQUEST, request)
    _, even = await raw.next_frame()
    assert (even.stream_id, decode_response(even.data).code) == (2, StatusCode.INVALID_ARGUMENT)
    await raw.send(1, 7, MessageType.REQUEST, request)
    _, ok = await raw.next_frame()
    assert (ok.stream_id, decode_response(ok.data).payload) == (7, b"x")
    # Ids may skip, but never go back.
    await raw.send(1, 5, MessageType.REQUEST, request)
    _, reused = await raw.next_frame()
    assert decode_response(reused.data).code == StatusCode.INVALID_ARGUMENT


async def test_undecodable_envelope_is_invalid_argument(served: tuple[TtrpcPeer, RawPeer]) -> None:
    _, raw = served
    await raw.send(1, 1, MessageType.REQUEST, b"\xff\xff\xff")
    _, frame = await raw.next_frame()
    assert decode_response(frame.data).code == StatusCode.INVALID_ARGUMENT


async def test_large_answer_follows_the_split_rule(served: tuple[TtrpcPeer, RawPeer]) -> None:
    _, raw = served
    payload = b"p" * 10_000
    await raw.send(1, 1, MessageType.REQUEST, encode_request(SERVICE, "Echo", payload))
    _, frame = await raw.next_frame()
    assert decode_response(frame.data).payload == payload
    total = 10 + len(frame.data)
    assert raw.mux_sizes == [4096, total - 4096]


async def test_oversize_call_is_refused_locally(peers: Peers) -> None:
    with pytest.raises(RpcError) as refused:
        await peers.client.call(SERVICE, "Echo", b"x" * (MAX_DATA_LENGTH + 1), timeout_s=5)
    assert refused.value.code == StatusCode.RESOURCE_EXHAUSTED
    assert await peers.client.call(SERVICE, "Echo", b"after", timeout_s=5) == b"after"


async def test_oversize_answer_becomes_resource_exhausted(peers: Peers) -> None:
    with pytest.raises(RpcError) as refused:
        await peers.client.call(SERVICE, "Huge", b"", timeout_s=5)
    assert refused.value.code == StatusCode.RESOURCE_EXHAUSTED


async def test_call_timeout_then_late_answer_dropped(served: tuple[TtrpcPeer, RawPeer]) -> None:
    peer, raw = served
    with pytest.raises(RpcError) as late:
        await peer.call("rt.Runtime", "Slow", b"", timeout_s=0.05)
    assert late.value.code == StatusCode.DEADLINE_EXCEEDED
    _, frame = await raw.next_frame()
    await raw.send(2, frame.stream_id, MessageType.RESPONSE, encode_response(b"late"))
    call = asyncio.create_task(peer.call("rt.Runtime", "Next", b"", timeout_s=3))
    _, second = await raw.next_frame()
    await raw.send(2, second.stream_id, MessageType.RESPONSE, encode_response(b"next"))
    assert await within(call) == b"next"


async def test_garbage_closes_connection_and_fails_pending_calls(
    served: tuple[TtrpcPeer, RawPeer],
) -> None:
    peer, raw = served
    call = asyncio.create_task(peer.call("rt.Runtime", "M", b"", timeout_s=WAIT_S))
    await raw.next_frame()
    # A mux header announcing 2 GiB: nothing after it can be trusted.
    raw.writer.write(b"\x00\x00\x00\x01\x80\x00\x00\x00garbage")
    await raw.writer.drain()
    with pytest.raises(ConnectionClosed):
        await within(call)
    assert peer.closed
    assert "protocol error" in peer.end_reason
    assert await within(raw.reader.read()) == b""


async def test_eof_fails_pending_calls(served: tuple[TtrpcPeer, RawPeer]) -> None:
    peer, raw = served
    call = asyncio.create_task(peer.call("rt.Runtime", "M", b"", timeout_s=WAIT_S))
    await raw.next_frame()
    raw.writer.close()
    with pytest.raises(ConnectionClosed):
        await within(call)
    with pytest.raises(ConnectionClosed):
        await peer.call("rt.Runtime", "M", b"", timeout_s=1)


# -- whatever the peer sends ------------------------------------------------------------------

FUZZ_HANDLERS: Mapping[tuple[str, str], Handler] = {
    (SERVICE, "EchoNow"): echo_now, (SERVICE, "Echo"): echo, (SERVICE, "FailNow"): fail_now,
}


def request_on(conn: int, stream_id: int, service: str, method: str, payload: bytes) -> bytes:
    return encode_message(conn, encode_frame(stream_id, MessageType.REQUEST,
                                             encode_request(service, method, payload)))


def any_frame(conn: int, stream_id: int, msg_type: int, data: bytes) -> bytes:
    message = struct.pack(">IIBB", len(data), stream_id, msg_type, 0) + data
    return struct.pack(">II", conn, len(message)) + message


def oversized_header(conn: int, stream_id: int, length: int) -> bytes:
    return struct.pack(">II", conn, 10) + struct.pack(">IIBB", length, stream_id, 1, 0)


wire_items = st.one_of(
    # Requests, served or not, on stream ids that may be even, repeated or going back.
    st.builds(request_on, st.sampled_from([1, 2]), st.integers(0, 40),
              st.sampled_from([SERVICE, "no.Such"]), st.sampled_from(["EchoNow", "Echo",
                                                                      "FailNow", "Nope"]),
              st.binary(max_size=32)),
    # Frames of any type, for any logical connection, with any data.
    st.builds(any_frame, st.integers(0, 4), st.integers(0, 2**32 - 1), st.integers(0, 255),
              st.binary(max_size=48)),
    # A header announcing more than the limit (what follows is taken as its data).
    st.builds(oversized_header, st.sampled_from([1, 2]), st.integers(0, 40),
              st.integers(MAX_DATA_LENGTH + 1, 2**32 - 1)),
    # Bytes that are no frame at all.
    st.binary(min_size=1, max_size=24),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(wire_items, max_size=12), st.data())
def test_the_peer_survives_any_bytes(items: list[bytes], data: st.DataObject) -> None:
    """Random bytes, truncated frames, oversized lengths, unknown connection ids and methods,
    even, repeated or decreasing stream ids: the peer never raises, never hangs (it ends at the
    runtime's EOF at the latest), and holds no more than it was sent."""
    wire = b"".join(items)
    wire = wire[: data.draw(st.integers(0, len(wire)))]

    async def scenario() -> tuple[TtrpcPeer, int]:
        ra, wa, rb, wb = await open_pair()
        peer = TtrpcPeer(ra, wa, serve_conn=1, call_conn=2, handlers=FUZZ_HANDLERS)
        tracemalloc.start()
        try:
            async with asyncio.timeout(5), asyncio.TaskGroup() as group:
                running = group.create_task(peer.run())
                wb.write(wire)
                wb.write_eof()
                while await rb.read(1 << 16):
                    pass
                await running
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            peer.close()
            wb.close()
        return peer, peak

    peer, peak = asyncio.run(scenario())
    assert peer.closed
    assert peer.end_reason.startswith(("connection closed by peer", "protocol error"))
    # What it was sent plus its own working buffers (about 1 MiB, which other threads' allocations
    # of the same process can tip over): far below the 4 MiB a frame header may announce.
    assert peak < len(wire) + (2 << 20)
