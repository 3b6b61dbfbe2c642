"""Reading the recordings of a real containerd, and checking what the plugin writes back against
the framing a Go runtime expects."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from nri_plugin.wire.mux import GO_BUFFER_SIZE, MuxDecoder
from nri_plugin.wire.ttrpc import FrameDecoder


def recorded_reads(path: Path) -> list[bytes]:
    """What the plugin read from the runtime, in the chunks it was read in."""
    with path.open() as lines:
        return [bytes.fromhex(r["hex"]) for r in map(json.loads, lines) if r["dir"] == "r2p"]


def runtime_messages(reads: list[bytes]) -> list[tuple[int, int, int, bytes]]:
    """The runtime's ttrpc frames in ``reads``: (mux connection, stream id, type, data)."""
    mux = MuxDecoder()
    decoders = {1: FrameDecoder(), 2: FrameDecoder()}
    out = []
    for chunk in reads:
        for conn, payload in mux.feed(chunk):
            out += [(conn, f.stream_id, f.type, f.data) for f in decoders[conn].feed(payload)]
    return out


def check_split_rule(written: bytes) -> list[tuple[int, int, int, int, bytes]]:
    """Walk the plugin's mux frames; each message must be [min(S, 4096)] + [rest], unmixed."""
    messages = []
    pos = 0
    pending: dict[int, bytearray] = {}
    while pos < len(written):
        assert len(written) - pos >= 8, "truncated mux header"
        conn, length = struct.unpack_from(">II", written, pos)
        payload = written[pos + 8:pos + 8 + length]
        assert len(payload) == length, "truncated mux frame"
        pos += 8 + length
        if conn in pending:
            buf = pending.pop(conn)
            (data_len,) = struct.unpack_from(">I", buf)
            assert length == 10 + data_len - len(buf), "second frame must hold exactly the rest"
            buf += payload
        else:
            assert length >= 10, "a message must start with its whole header"
            (data_len,) = struct.unpack_from(">I", payload)
            size = 10 + data_len
            assert length == min(size, GO_BUFFER_SIZE), f"first frame {length} for message {size}"
            buf = bytearray(payload)
            if size > GO_BUFFER_SIZE:
                pending[conn] = buf
                continue
        data_len, stream_id, msg_type, flags = struct.unpack_from(">IIBB", buf)
        messages.append((conn, stream_id, msg_type, flags, bytes(buf[10:])))
    assert not pending, "a message was left incomplete"
    return messages


def ends_on_a_message_boundary(written: bytearray) -> bool:
    """True when ``written`` ends on a message boundary (no half-written message)."""
    pos = 0
    open_rest: dict[int, int] = {}
    while pos + 8 <= len(written):
        conn, length = struct.unpack_from(">II", written, pos)
        if pos + 8 + length > len(written):
            return False
        if conn in open_rest:
            del open_rest[conn]
        else:
            (data_len,) = struct.unpack_from(">I", written, pos + 8)
            if 10 + data_len > length:
                open_rest[conn] = 10 + data_len - length
        pos += 8 + length
    return pos == len(written) and not open_rest
