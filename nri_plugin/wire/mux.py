"""NRI's connection multiplexer, without I/O.

NRI runs two ttrpc sessions over one unix socket. Each mux frame is an 8-byte
big-endian header (connection id u32, payload length u32) followed by the next
piece of that logical connection's byte stream. Mux frame boundaries have no
relation to ttrpc frame boundaries, so every logical connection gets its own
:class:`~nri_plugin.wire.ttrpc.FrameDecoder`.
"""

from __future__ import annotations

import struct

from nri_plugin.wire.errors import MessageTooLarge, ProtocolError
from nri_plugin.wire.ttrpc import HEADER_SIZE, MAX_DATA_LENGTH, Frame, FrameDecoder

MUX_HEADER_SIZE = 8
PLUGIN_SERVICE_CONN = 1
"""The runtime calls the plugin's ``Plugin`` service here (the plugin is the ttrpc server)."""
RUNTIME_SERVICE_CONN = 2
"""The plugin calls the runtime's ``Runtime`` service here (the plugin is the ttrpc client)."""
GO_BUFFER_SIZE = 4096
"""Size of the Go peer's ttrpc read buffer, which dictates how we must split messages."""
MAX_MUX_PAYLOAD = 1 << 24
"""Largest mux payload accepted (16 MiB). Current runtimes send at most one ttrpc frame
(4 MiB + 10) per mux frame, but older ones (NRI <= 0.6) wrote up to 16 MiB unsplit; a header
announcing more is taken for lost framing. Payloads are streamed, never held whole."""
MAX_CONN_ID = 2**32 - 1

_MUX_HEADER = struct.Struct(">II")
_KNOWN_CONNS = frozenset((PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN))


def split_sizes(size: int) -> tuple[int] | tuple[int, int]:
    """Mux payload sizes for one ttrpc message of ``size`` bytes (header included).

    The Go reader fails on a mux frame that starts a ttrpc message and is larger
    than its 4096-byte buffer, and on one that runs past the end of the message.
    So the first frame carries ``min(size, 4096)`` bytes and a second one, if
    needed, all of the rest; this is also how Go itself writes.
    """
    if size <= GO_BUFFER_SIZE:
        return (size,)
    return (GO_BUFFER_SIZE, size - GO_BUFFER_SIZE)


def encode_message(conn_id: int, ttrpc_message: bytes) -> bytes:
    """Wrap exactly one encoded ttrpc frame in one or two mux frames.

    The result must be handed to the transport in a single write, so that no
    other message can come between the two frames.
    Raises :class:`ValueError` if ``ttrpc_message`` is not exactly one whole
    ttrpc frame or ``conn_id`` is not a usable connection id, and
    :class:`MessageTooLarge` if the frame's data exceeds the ttrpc limit.
    """
    if not 1 <= conn_id <= MAX_CONN_ID:
        raise ValueError(f"mux connection id {conn_id} is outside 1..{MAX_CONN_ID}")
    size = len(ttrpc_message)
    if size < HEADER_SIZE:
        raise ValueError(f"a ttrpc message has at least {HEADER_SIZE} bytes, got {size}")
    (length,) = struct.unpack_from(">I", ttrpc_message)
    if length > MAX_DATA_LENGTH:
        raise MessageTooLarge(length, MAX_DATA_LENGTH)
    if HEADER_SIZE + length != size:
        raise ValueError(
            f"expected exactly one ttrpc frame: header announces {HEADER_SIZE + length} bytes, "
            f"got {size}"
        )
    view = memoryview(ttrpc_message)
    parts: list[bytes | memoryview] = []
    pos = 0
    for n in split_sizes(size):
        parts += (_MUX_HEADER.pack(conn_id, n), view[pos : pos + n])
        pos += n
    return b"".join(parts)


class MuxStream:
    """Cuts the socket's byte stream into pieces of the logical connections' streams.

    Pieces come out as soon as they arrive, as views of the input (no copy): a
    mux frame's boundaries mean nothing to the ttrpc stream it carries, so
    nothing is held back but a partial header, whatever a header announces.
    Frames for connection ids other than 1 and 2 (including the reserved 0) are
    skipped as they arrive, as the Go mux drops ids it has not opened, and
    counted in :attr:`dropped_frames`.
    """

    def __init__(self) -> None:
        self._header = bytearray()
        # The frame whose payload is arriving: its connection, the bytes still to come, and
        # whether it is for a known connection (else it is skipped).
        self._conn = 0
        self._left = 0
        self._known = False
        self._error: str | None = None
        self.dropped_frames = 0

    @property
    def buffered(self) -> int:
        """Header bytes held back because the header is not complete yet."""
        return len(self._header)

    @property
    def in_frame(self) -> bool:
        """A mux frame has begun and not ended: the rest of it is still to come."""
        return self._left > 0 or bool(self._header)

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[int, memoryview, bool]]:
        """Add bytes; return ``(conn_id, piece, frame_ends)`` for every piece of payload
        they carry for connection 1 or 2 (an empty mux frame gives one empty piece).

        Raises :class:`ProtocolError` as soon as a header announces more than
        :data:`MAX_MUX_PAYLOAD` bytes. After that the stream refuses all further input.
        """
        if self._error is not None:
            raise ProtocolError(f"mux decoder already failed: {self._error}")
        pieces: list[tuple[int, memoryview, bool]] = []
        view = memoryview(data)
        end = len(view)
        pos = 0
        while pos < end:
            if self._left:
                n = min(self._left, end - pos)
                self._left -= n
                if self._known:
                    pieces.append((self._conn, view[pos : pos + n], not self._left))
                pos += n
                continue
            header = self._header
            if header or end - pos < MUX_HEADER_SIZE:
                taken = min(MUX_HEADER_SIZE - len(header), end - pos)
                header += view[pos : pos + taken]
                pos += taken
                if len(header) < MUX_HEADER_SIZE:
                    break
                conn_id, length = _MUX_HEADER.unpack(header)
                header.clear()
            else:
                conn_id, length = _MUX_HEADER.unpack_from(view, pos)
                pos += MUX_HEADER_SIZE
            if length > MAX_MUX_PAYLOAD:
                self._error = (
                    f"mux frame for connection {conn_id} announces {length} bytes, "
                    f"more than the limit of {MAX_MUX_PAYLOAD}"
                )
                raise ProtocolError(self._error)
            self._conn, self._left = conn_id, length
            self._known = conn_id in _KNOWN_CONNS
            if not self._known:
                self.dropped_frames += 1
            elif not length:
                pieces.append((conn_id, view[pos:pos], True))
        return pieces


class MuxDecoder:
    """Cuts whole mux frames out of the socket's byte stream (to look at the framing itself;
    the plugin's reader streams through :class:`Demultiplexer` instead).

    Frames for connection ids other than 1 and 2 are dropped, and counted in
    :attr:`dropped_frames`.
    """

    def __init__(self) -> None:
        self._stream = MuxStream()
        self._payload = bytearray()

    @property
    def dropped_frames(self) -> int:
        return self._stream.dropped_frames

    @property
    def buffered(self) -> int:
        """Bytes held back because they do not yet form a whole mux frame."""
        stream = self._stream
        if stream.buffered or not stream.in_frame:
            return stream.buffered
        return MUX_HEADER_SIZE + len(self._payload)

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Add bytes; return ``(conn_id, payload)`` for every frame they complete.

        Raises :class:`ProtocolError` as soon as a header announces more than
        :data:`MAX_MUX_PAYLOAD` bytes, before buffering the payload. After that
        the decoder refuses all further input.
        """
        frames: list[tuple[int, bytes]] = []
        for conn_id, piece, ends in self._stream.feed(data):
            self._payload += piece
            if ends:
                frames.append((conn_id, bytes(self._payload)))
                self._payload.clear()
        return frames


class Demultiplexer:
    """Socket bytes in, ``(conn_id, ttrpc Frame)`` pairs out, in arrival order.

    It holds at most a partial mux header and one partial ttrpc frame per logical connection
    (oversized ttrpc frames are skipped, not held: see
    :class:`~nri_plugin.wire.ttrpc.FrameDecoder`).
    """

    def __init__(self) -> None:
        self._mux = MuxStream()
        self._plugin = FrameDecoder()
        self._runtime = FrameDecoder()
        self._conns = {PLUGIN_SERVICE_CONN: self._plugin, RUNTIME_SERVICE_CONN: self._runtime}

    @property
    def dropped_frames(self) -> int:
        """Mux frames dropped because their connection id is not 1 or 2."""
        return self._mux.dropped_frames

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a returned frame (non-zero at EOF: truncated)."""
        return self._mux.buffered + self._plugin.buffered + self._runtime.buffered

    @property
    def in_frame(self) -> bool:
        """A mux or ttrpc frame has begun and not ended: the peer owes the rest of it."""
        return self._mux.in_frame or self._plugin.in_frame or self._runtime.in_frame

    def feed(self, data: bytes) -> list[tuple[int, Frame]]:
        """Add socket bytes; return every ttrpc frame they complete, with its connection id.

        A :class:`ProtocolError` (the mux framing is lost) means the connection must be closed:
        frames completed earlier in the same call are not returned, and all further input is
        refused.
        """
        out: list[tuple[int, Frame]] = []
        conns = self._conns
        # The mux stream remembers a lost framing and refuses everything after it.
        pieces = self._mux.feed(data)
        for conn_id, piece, _ in pieces:
            if piece:
                out += ((conn_id, frame) for frame in conns[conn_id].feed(piece))
        return out
