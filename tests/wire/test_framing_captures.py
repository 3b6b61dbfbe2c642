"""Replay recordings of real containerd NRI traffic through the framing layers.

Each recording is JSON lines, one per socket read: ``{"t", "dir", "hex"}`` with
``dir`` either ``r2p`` (runtime to plugin) or ``p2r`` (plugin to runtime). The
expected messages come from ``capdump.py``, an independent reference decoder
stored beside the recordings. ``NRI_CAPTURES_DIR`` overrides where they live.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from nri_plugin.wire.mux import (
    PLUGIN_SERVICE_CONN,
    RUNTIME_SERVICE_CONN,
    Demultiplexer,
    MuxDecoder,
    encode_message,
)
from nri_plugin.wire.ttrpc import HEADER_SIZE, MessageType, ServerStreams, encode_frame
from tests.support.paths import CAPTURES, RECORDINGS, load_reference_decoder

DIRECTIONS = ("r2p", "p2r")

pytestmark = pytest.mark.skipif(not RECORDINGS, reason=f"no recordings in {CAPTURES}")

Message = tuple[int, int, int, int, bytes]  # conn id, stream id, type, flags, data


def socket_reads(path: Path, direction: str) -> list[bytes]:
    with path.open() as lines:
        records = [json.loads(line) for line in lines]
    return [bytes.fromhex(r["hex"]) for r in records if r["dir"] == direction]


def reference_messages(path: Path, direction: str) -> list[Message]:
    reference = load_reference_decoder()
    return [
        (conn_id, stream_id, msg_type, flags, bytes(data))
        for _, d, conn_id, stream_id, msg_type, flags, data in reference.messages(str(path))
        if d == direction
    ]


def demultiplex(chunks: list[bytes]) -> list[Message]:
    demux = Demultiplexer()
    out: list[Message] = []
    for chunk in chunks:
        out += ((c, f.stream_id, f.type, f.flags, f.data) for c, f in demux.feed(chunk))
    assert demux.buffered == 0
    assert demux.dropped_frames == 0
    return out


def split_rule_violations(mux_frames: list[tuple[int, bytes]]) -> list[str]:
    """Where a mux stream breaks the writer rule: a ttrpc message of S bytes goes out as one
    frame of min(S, 4096) bytes, then (if S > 4096) the whole rest as the very next frame."""
    violations: list[str] = []
    owed: tuple[int, int] | None = None  # conn id and size of the frame that must come next
    for index, (conn_id, payload) in enumerate(mux_frames):
        if owed is not None:
            if (conn_id, len(payload)) != owed:
                violations.append(
                    f"frame {index}: expected the remaining {owed[1]} bytes on conn {owed[0]}, "
                    f"got {len(payload)} on conn {conn_id}"
                )
            owed = None
            continue
        if len(payload) < HEADER_SIZE:
            violations.append(f"frame {index}: {len(payload)} bytes cannot start a ttrpc message")
            continue
        (length,) = struct.unpack_from(">I", payload)
        size = HEADER_SIZE + length
        if len(payload) != min(size, 4096):
            violations.append(
                f"frame {index}: starts a {size}-byte message but carries {len(payload)} bytes"
            )
        elif size > 4096:
            owed = (conn_id, size - 4096)
    if owed is not None:
        violations.append(f"stream ends owing {owed[1]} bytes on conn {owed[0]}")
    return violations


@pytest.fixture(params=RECORDINGS, ids=[p.stem for p in RECORDINGS])
def recording(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_read_by_read_matches_reference_decoder(recording: Path, direction: str) -> None:
    expected = reference_messages(recording, direction)
    assert expected
    assert demultiplex(socket_reads(recording, direction)) == expected


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_byte_at_a_time_matches_reference_decoder(recording: Path, direction: str) -> None:
    raw = b"".join(socket_reads(recording, direction))
    one_byte_reads = [raw[i : i + 1] for i in range(len(raw))]
    assert demultiplex(one_byte_reads) == reference_messages(recording, direction)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_every_message_follows_the_split_rule(recording: Path, direction: str) -> None:
    # p2r was written by the reference Go plugin, r2p by containerd: both follow the rule
    # our writer implements, and the r2p side of some recordings holds a split message.
    mux_frames = MuxDecoder().feed(b"".join(socket_reads(recording, direction)))
    assert split_rule_violations(mux_frames) == []


def test_recordings_include_a_split_message() -> None:
    sizes = [
        len(payload)
        for path in RECORDINGS
        for _, payload in MuxDecoder().feed(b"".join(socket_reads(path, "r2p")))
    ]
    assert 4096 in sizes


def test_split_rule_checker_catches_violations() -> None:
    big = encode_frame(1, MessageType.REQUEST, bytes(6000))
    small = encode_frame(3, MessageType.REQUEST, b"x")
    assert split_rule_violations(MuxDecoder().feed(encode_message(1, big))) == []
    bad_streams = [
        [(1, big)],  # one frame larger than 4096 starting a message
        [(1, small + small)],  # two messages in one frame
        [(1, small[:5]), (1, small[5:])],  # a small message split
        [(1, big[:4096]), (2, small), (1, big[4096:])],  # another message in between
        [(1, big[:4096])],  # the rest never comes
    ]
    for frames in bad_streams:
        assert split_rule_violations(frames), frames


@pytest.mark.parametrize(
    ("direction", "conn_id"), [("r2p", PLUGIN_SERVICE_CONN), ("p2r", RUNTIME_SERVICE_CONN)]
)
def test_request_stream_ids_are_odd_and_increasing(
    recording: Path, direction: str, conn_id: int
) -> None:
    ids = [
        stream_id
        for c, stream_id, msg_type, _, _ in demultiplex(socket_reads(recording, direction))
        if c == conn_id and msg_type == MessageType.REQUEST
    ]
    assert ids
    assert all(i % 2 == 1 for i in ids)
    assert ids == sorted(set(ids))
    server = ServerStreams()
    assert [server.accept(i) for i in ids] == [None] * len(ids)
