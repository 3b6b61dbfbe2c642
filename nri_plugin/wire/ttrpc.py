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

from nri_plugin.wire.errors import MessageTooLarge, StreamIdsExhausted
from nri_plugin.wire.status import StatusCode

HEADER_SIZE = 10
MAX_DATA_LENGTH = 4 << 20
"""Largest data section ttrpc accepts (4 MiB); the header is not counted."""
MAX_STREAM_ID = 2**32 - 1

_HEADER = struct.Struct(">IIBB")


class MessageType(IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded ttrpc frame.

    ``type`` stays a plain int: peers may send types this module does not know,
    and it is the session layer that decides to ignore them. ``oversized`` is
    the data length announced by a frame over :data:`MAX_DATA_LENGTH`; its data
    was skipped, not kept (``data`` is then empty), and the receiver answers
    that stream RESOURCE_EXHAUSTED, as the Go implementation does.
    """

    stream_id: int
    type: int
    flags: int
    data: bytes
    oversized: int = 0


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


def oversized_message(length: int) -> str:
    """The status text answering a frame of ``length`` data bytes (the Go server's words)."""
    return f"message length {length} exceed maximum message size of {MAX_DATA_LENGTH}"


class FrameDecoder:
    """Cuts ttrpc frames out of one logical connection's byte stream.

    Input may be split anywhere. Only the bytes of a frame still incomplete are
    kept, in one bytearray that is only appended to and trimmed at the front
    (which CPython does in place), so a large frame arriving in small pieces
    costs linear time; input that holds whole frames is cut without being
    copied into it. A frame announcing more than :data:`MAX_DATA_LENGTH` bytes
    is not an error: its data is skipped as it arrives, without being kept, and
    the frame comes out with ``oversized`` set and no data once it has all gone
    by. So the decoder never fails: every byte sequence is some sequence of
    frames, and it holds at most one frame's worth of bytes.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        # Data bytes of an oversized frame still to be skipped, and that frame (without data).
        self._skip = 0
        self._skipped: Frame | None = None

    @property
    def buffered(self) -> int:
        """Bytes held back because they do not yet form a whole frame."""
        return len(self._buf)

    @property
    def in_frame(self) -> bool:
        """A frame has begun and not ended: the rest of it is still to come."""
        return bool(self._buf) or self._skip > 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Add bytes; return every frame they complete, in order."""
        frames: list[Frame] = []
        buf = self._buf
        if buf:
            buf += data
            with memoryview(buf) as view:
                used = self._cut(view, frames)
            del buf[:used]
        else:
            with memoryview(data) as view:
                used = self._cut(view, frames)
                if used < len(view):
                    buf += view[used:]
        return frames

    def _cut(self, view: memoryview, frames: list[Frame]) -> int:
        """Append the frames ``view`` completes to ``frames``; the bytes they used up."""
        end = len(view)
        pos = 0
        while True:
            if self._skip:
                skipped = min(self._skip, end - pos)
                pos += skipped
                self._skip -= skipped
                if self._skip:
                    return pos
                assert self._skipped is not None
                frames.append(self._skipped)
                self._skipped = None
            if end - pos < HEADER_SIZE:
                return pos
            length, stream_id, msg_type, flags = _HEADER.unpack_from(view, pos)
            if length > MAX_DATA_LENGTH:
                pos += HEADER_SIZE
                self._skip = length
                self._skipped = Frame(stream_id, msg_type, flags, b"", length)
                continue
            stop = pos + HEADER_SIZE + length
            if stop > end:
                return pos
            frames.append(Frame(stream_id, msg_type, flags, bytes(view[pos + HEADER_SIZE : stop])))
            pos = stop


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
