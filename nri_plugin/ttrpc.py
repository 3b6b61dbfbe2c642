"""ttrpc framing and stream-id bookkeeping, without I/O.

A ttrpc frame is a 10-byte big-endian header (data length u32, stream id u32,
message type u8, flags u8) followed by the data: a protobuf ``ttrpc.Request``
or ``ttrpc.Response``. Bytes go in, :class:`Frame` objects come out; the
asyncio layer does the reading and writing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from nri_plugin.errors import MessageTooLarge, ProtocolError, StreamIdsExhausted

HEADER_SIZE = 10
MAX_DATA_LENGTH = 4 << 20
"""Largest data section ttrpc accepts (4 MiB); the header is not counted."""
MAX_STREAM_ID = 2**32 - 1

_HEADER = struct.Struct(">IIBB")


class MessageType(IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


class StatusCode(IntEnum):
    """gRPC status codes, carried in ``ttrpc.Response.status.code``."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded ttrpc frame.

    ``type`` stays a plain int: peers may send types this module does not know,
    and it is the session layer that decides to ignore them.
    """

    stream_id: int
    type: int
    flags: int
    data: bytes


def encode_frame(stream_id: int, msg_type: int, data: bytes, flags: int = 0) -> bytes:
    """Header plus data, ready to be handed to the mux writer.

    Raises :class:`MessageTooLarge` for data over 4 MiB (the peer would discard
    it) and :class:`ValueError` for header fields out of their ranges.
    """
    if len(data) > MAX_DATA_LENGTH:
        raise MessageTooLarge(len(data), MAX_DATA_LENGTH)
    if not 0 <= stream_id <= MAX_STREAM_ID:
        raise ValueError(f"stream id {stream_id} is outside 0..{MAX_STREAM_ID}")
    if not 0 <= msg_type <= 0xFF:
        raise ValueError(f"message type {msg_type} is outside 0..255")
    if not 0 <= flags <= 0xFF:
        raise ValueError(f"flags {flags} are outside 0..255")
    return _HEADER.pack(len(data), stream_id, msg_type, flags) + data


class FrameDecoder:
    """Cuts ttrpc frames out of one logical connection's byte stream.

    Input may be split anywhere. Bytes accumulate in one bytearray that is only
    appended to and trimmed at the front (which CPython does in place), so a
    large frame arriving in small pieces costs linear time.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._error: str | None = None

    @property
    def buffered(self) -> int:
        """Bytes held back because they do not yet form a whole frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        """Add bytes; return every frame they complete, in order.

        Raises :class:`ProtocolError` as soon as a header announces more than
        :data:`MAX_DATA_LENGTH` bytes, without waiting for (or buffering) the
        data. After that the decoder refuses all further input.
        """
        if self._error is not None:
            raise ProtocolError(f"ttrpc decoder already failed: {self._error}")
        buf = self._buf
        buf += data
        end = len(buf)
        pos = 0
        frames: list[Frame] = []
        with memoryview(buf) as view:
            while end - pos >= HEADER_SIZE:
                length, stream_id, msg_type, flags = _HEADER.unpack_from(buf, pos)
                if length > MAX_DATA_LENGTH:
                    self._error = (
                        f"ttrpc frame on stream {stream_id} announces {length} bytes of data, "
                        f"more than the limit of {MAX_DATA_LENGTH}"
                    )
                    break
                stop = pos + HEADER_SIZE + length
                if stop > end:
                    break
                frames.append(
                    Frame(stream_id, msg_type, flags, bytes(view[pos + HEADER_SIZE : stop]))
                )
                pos = stop
        if self._error is not None:
            buf.clear()
            raise ProtocolError(self._error)
        if pos:
            del buf[:pos]
        return frames


class ClientStreams:
    """Stream ids of the requests a ttrpc client has in flight.

    Ids are odd and strictly increasing, starting at ``first_id`` (1 on a new
    connection), as the Go server requires.
    """

    def __init__(self, *, first_id: int = 1) -> None:
        if first_id % 2 == 0 or not 1 <= first_id <= MAX_STREAM_ID:
            raise ValueError(f"first stream id must be odd and within 1..{MAX_STREAM_ID}")
        self._next = first_id
        self._open: set[int] = set()

    def open(self) -> int:
        """Allocate the id for a new request.

        Raises :class:`StreamIdsExhausted` once the 32-bit space is used up;
        reusing an id would be rejected by the server.
        """
        stream_id = self._next
        if stream_id > MAX_STREAM_ID:
            raise StreamIdsExhausted(f"all odd stream ids up to {MAX_STREAM_ID} are used")
        self._next = stream_id + 2
        self._open.add(stream_id)
        return stream_id

    def close(self, stream_id: int) -> bool:
        """Finish a stream. False means it was not pending: drop that response."""
        try:
            self._open.remove(stream_id)
        except KeyError:
            return False
        return True

    @property
    def pending(self) -> int:
        """Number of requests still waiting for their response."""
        return len(self._open)


class ServerStreams:
    """Checks the stream ids of incoming requests on one ttrpc server connection.

    Ids must be odd and strictly increasing; they may skip, since a client
    allocates an id before a send that can still fail locally.
    """

    def __init__(self) -> None:
        self._last = 0

    def accept(self, stream_id: int) -> StatusCode | None:
        """None if the request may be served; otherwise the status to answer with.

        A rejected id does not advance the connection's last seen id.
        """
        if self.rejection_message(stream_id) is not None:
            return StatusCode.INVALID_ARGUMENT
        self._last = stream_id
        return None

    def rejection_message(self, stream_id: int) -> str | None:
        """Why :meth:`accept` refuses ``stream_id`` right now, or None if it would not."""
        if stream_id % 2 == 0:
            return f"stream id {stream_id} is even; client-initiated streams must use odd ids"
        if stream_id <= self._last:
            return (
                f"stream id {stream_id} is not greater than the last one ({self._last}); "
                "stream ids cannot be reused and must increase"
            )
        return None
