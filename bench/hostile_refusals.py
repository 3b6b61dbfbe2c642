"""The refusals of the hostile-runtime benchmark: requests the wire protocol refuses on a
connection that stays usable (each returns what came back)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from nri_plugin.wire.envelope import encode_response
from nri_plugin.wire.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, encode_message
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.ttrpc import MessageType, encode_frame
from tests.support.raw_runtime import RawRuntime, mux_frame

Send = Callable[[RawRuntime], Awaitable[str]]
"""Sends something the agent refuses on a connection that stays usable; what came back."""


class Hang(Exception):
    """A bounded wait ran out."""


async def even_stream(conn: RawRuntime) -> str:
    conn.write(conn.request_bytes("CreateContainer", b"", 2))
    return await answered(conn, 2, "even stream id")


async def reused_stream(conn: RawRuntime) -> str:
    # The handshake used 1 and 3.
    conn.write(conn.request_bytes("CreateContainer", b"", 3))
    return await answered(conn, 3, "reused stream id")


async def unknown_service(conn: RawRuntime) -> str:
    stream_id = conn.stream()
    conn.write(conn.request_bytes("CreateContainer", b"", stream_id, service="no.Such"))
    return await answered(conn, stream_id, "unknown service")


async def unknown_method(conn: RawRuntime) -> str:
    stream_id = conn.stream()
    conn.write(conn.request_bytes("NoSuchMethod", b"", stream_id))
    return await answered(conn, stream_id, "unknown method")


async def bad_envelope(conn: RawRuntime) -> str:
    stream_id = conn.stream()
    conn.write(encode_message(PLUGIN_SERVICE_CONN, encode_frame(
        stream_id, MessageType.REQUEST, b"\xff\xff\xff")))
    return await answered(conn, stream_id, "bad envelope")


async def unknown_frame_type(conn: RawRuntime) -> str:
    conn.write(encode_message(PLUGIN_SERVICE_CONN, encode_frame(conn.stream(), 0x7E, b"?")))
    return "frame of type 0x7e ignored"


async def unknown_connection(conn: RawRuntime) -> str:
    conn.write(mux_frame(9, b"hello"))
    return "mux frame for connection 9 skipped"


async def stray_response(conn: RawRuntime) -> str:
    conn.write(encode_message(RUNTIME_SERVICE_CONN, encode_frame(
        99, MessageType.RESPONSE, encode_response(b"stray"))))
    return "response for a call never made dropped"


async def answered(conn: RawRuntime, stream_id: int, what: str) -> str:
    reply = await conn.answer(stream_id)
    return f"{what}: {StatusCode(reply.code).name}"
