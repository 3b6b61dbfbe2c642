"""NRI's connection multiplexer, without I/O.

NRI runs two ttrpc sessions over one unix socket. Each mux frame is an 8-byte
big-endian header (connection id u32, payload length u32) followed by the next
piece of that logical connection's byte stream. Mux frame boundaries have no
relation to ttrpc frame boundaries, so every logical connection gets its own
:class:`~nri_plugin.ttrpc.FrameDecoder`.
"""

from __future__ import annotations

import struct

from nri_plugin.errors import MessageTooLarge, ProtocolError
from nri_plugin.ttrpc import HEADER_SIZE, MAX_DATA_LENGTH, Frame, FrameDecoder

MUX_HEADER_SIZE = 8
PLUGIN_SERVICE_CONN = 1
"""The runtime calls the plugin's ``Plugin`` service here (the plugin is the ttrpc server)."""
RUNTIME_SERVICE_CONN = 2
"""The plugin calls the runtime's ``Runtime`` service here (the plugin is the ttrpc client)."""
GO_BUFFER_SIZE = 4096
"""Size of the Go peer's ttrpc read buffer, which dictates how we must split messages."""
MAX_MUX_PAYLOAD = 1 << 24
"""Largest mux payload accepted (16 MiB). Current runtimes send at most one ttrpc frame
(4 MiB + 10) per mux frame, but older ones (NRI <= 0.6) wrote up to 16 MiB unsplit."""
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


class MuxDecoder:
    """Cuts mux frames out of the socket's byte stream.

    Frames for connection ids other than 1 and 2 (including the reserved 0) are
    dropped silently, as the Go mux does for ids it has not opened, and counted
    in :attr:`dropped_frames`.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._error: str | None = None
        self.dropped_frames = 0

    @property
    def buffered(self) -> int:
        """Bytes held back because they do not yet form a whole mux frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Add bytes; return ``(conn_id, payload)`` for every frame they complete.

        Raises :class:`ProtocolError` as soon as a header announces more than
        :data:`MAX_MUX_PAYLOAD` bytes, before buffering the payload. After that
        the decoder refuses all further input.
        """
        if self._error is not None:
            raise ProtocolError(f"mux decoder already failed: {self._error}")
        buf = self._buf
        buf += data
        end = len(buf)
        pos = 0
        frames: list[tuple[int, bytes]] = []
        with memoryview(buf) as view:
            while end - pos >= MUX_HEADER_SIZE:
                conn_id, length = _MUX_HEADER.unpack_from(buf, pos)
                if length > MAX_MUX_PAYLOAD:
                    self._error = (
                        f"mux frame for connection {conn_id} announces {length} bytes, "
                        f"more than the limit of {MAX_MUX_PAYLOAD}"
                    )
                    break
                stop = pos + MUX_HEADER_SIZE + length
                if stop > end:
                    break
                if conn_id in _KNOWN_CONNS:
                    frames.append((conn_id, bytes(view[pos + MUX_HEADER_SIZE : stop])))
                else:
                    self.dropped_frames += 1
                pos = stop
        if self._error is not None:
            buf.clear()
            raise ProtocolError(self._error)
        if pos:
            del buf[:pos]
        return frames


class Demultiplexer:
    """Socket bytes in, ``(conn_id, ttrpc Frame)`` pairs out, in arrival order."""

    def __init__(self) -> None:
        self._mux = MuxDecoder()
        self._conns = {conn_id: FrameDecoder() for conn_id in sorted(_KNOWN_CONNS)}
        self._error: str | None = None

    @property
    def dropped_frames(self) -> int:
        """Mux frames dropped because their connection id is not 1 or 2."""
        return self._mux.dropped_frames

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a returned frame (non-zero at EOF: truncated)."""
        return self._mux.buffered + sum(d.buffered for d in self._conns.values())

    def feed(self, data: bytes) -> list[tuple[int, Frame]]:
        """Add socket bytes; return every ttrpc frame they complete, with its connection id.

        A :class:`ProtocolError` (from either layer) means the connection must be
        closed: frames completed earlier in the same call are not returned, and
        all further input is refused. ttrpc-level errors carry a note naming the
        mux connection.
        """
        if self._error is not None:
            raise ProtocolError(f"demultiplexer already failed: {self._error}")
        out: list[tuple[int, Frame]] = []
        conn_id: int | None = None
        try:
            for conn_id, payload in self._mux.feed(data):
                out += ((conn_id, frame) for frame in self._conns[conn_id].feed(payload))
        except ProtocolError as exc:
            if conn_id is not None:
                exc.add_note(f"on mux connection {conn_id}")
            self._error = str(exc)
            raise
        return out
