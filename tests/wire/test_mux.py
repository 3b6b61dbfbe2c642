"""NRI mux framing: decoding, demultiplexing, and the writer's split rule."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nri_plugin.wire.errors import MessageTooLarge, ProtocolError
from nri_plugin.wire.mux import (
    GO_BUFFER_SIZE,
    MAX_MUX_PAYLOAD,
    MUX_HEADER_SIZE,
    PLUGIN_SERVICE_CONN,
    RUNTIME_SERVICE_CONN,
    Demultiplexer,
    MuxDecoder,
    encode_message,
    split_sizes,
)
from nri_plugin.wire.ttrpc import (
    HEADER_SIZE,
    MAX_DATA_LENGTH,
    MAX_STREAM_ID,
    Frame,
    MessageType,
    encode_frame,
)


def mux_frame(conn_id: int, payload: bytes) -> bytes:
    return struct.pack(">II", conn_id, len(payload)) + payload


def feed_at(decoder: MuxDecoder | Demultiplexer, data: bytes, cuts: list[int]) -> list[object]:
    out: list[object] = []
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        out += decoder.feed(data[start:cut])
        start = cut
    return out


def ttrpc_message(size: int, stream_id: int = 1) -> bytes:
    """An encoded ttrpc frame of exactly ``size`` bytes, header included."""
    data = (bytes(range(256)) * (size // 256 + 1))[: size - 10]
    return encode_frame(stream_id, MessageType.REQUEST, data)


def conn_frames(max_data: int) -> st.SearchStrategy[list[tuple[int, Frame]]]:
    frame = st.builds(
        Frame,
        stream_id=st.integers(0, MAX_STREAM_ID),
        type=st.integers(0, 255),
        flags=st.integers(0, 255),
        data=st.binary(max_size=max_data),
    )
    return st.lists(st.tuples(st.sampled_from([1, 2]), frame), max_size=6)


def test_constants() -> None:
    assert (MUX_HEADER_SIZE, PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN) == (8, 1, 2)
    assert GO_BUFFER_SIZE == 4096
    assert MAX_MUX_PAYLOAD >= MAX_DATA_LENGTH + 10


def test_mux_decoder_yields_frames_per_conn_and_keeps_partials() -> None:
    raw = mux_frame(1, b"abc") + mux_frame(2, b"") + mux_frame(2, b"defg")
    decoder = MuxDecoder()
    assert decoder.feed(raw[:-2]) == [(1, b"abc"), (2, b"")]
    assert decoder.buffered == MUX_HEADER_SIZE + 2
    assert decoder.feed(raw[-2:]) == [(2, b"defg")]
    assert decoder.buffered == 0


@pytest.mark.parametrize("conn_id", [0, 3, 0xFFFFFFFF])
def test_unknown_and_reserved_conn_ids_are_dropped_and_counted(conn_id: int) -> None:
    decoder = MuxDecoder()
    raw = mux_frame(conn_id, b"zz") + mux_frame(1, b"x") + mux_frame(conn_id, b"")
    assert decoder.feed(raw) == [(1, b"x")]
    assert decoder.dropped_frames == 2


def test_oversize_mux_length_rejected_before_payload() -> None:
    decoder = MuxDecoder()
    header = struct.pack(">II", 1, MAX_MUX_PAYLOAD + 1)
    assert decoder.feed(header[:7]) == []
    with pytest.raises(ProtocolError, match=f"connection 1 announces {MAX_MUX_PAYLOAD + 1} bytes"):
        decoder.feed(header[7:])
    with pytest.raises(ProtocolError, match="already failed"):
        decoder.feed(mux_frame(1, b"x"))


def test_largest_mux_payload_is_accepted() -> None:
    # Old runtimes write a whole ttrpc message (up to 4 MiB + 10) in one frame.
    assert MuxDecoder().feed(struct.pack(">II", 2, MAX_MUX_PAYLOAD)) == []
    message = ttrpc_message(MAX_DATA_LENGTH + 10)
    assert Demultiplexer().feed(mux_frame(1, message)) == [
        (1, Frame(1, 1, 0, message[10:])),
    ]


@given(conn_frames(5000), st.data())
def test_demultiplexer_whole_vs_random_splits(
    items: list[tuple[int, Frame]], data: st.DataObject
) -> None:
    # Concatenate every conn's ttrpc bytes, then cut them into mux frames at
    # random points, so mux frames hold partial and multiple ttrpc frames.
    wire = b""
    for conn_id, frame in items:
        message = encode_frame(frame.stream_id, frame.type, frame.data, frame.flags)
        cuts = sorted(data.draw(st.lists(st.integers(0, len(message)), max_size=3)))
        for start, stop in zip([0, *cuts], [*cuts, len(message)], strict=True):
            wire += mux_frame(conn_id, message[start:stop])
    read_cuts = data.draw(st.lists(st.integers(0, len(wire)), max_size=10))
    assert Demultiplexer().feed(wire) == items
    assert feed_at(Demultiplexer(), wire, read_cuts) == items


@given(conn_frames(500))
def test_demultiplexer_one_byte_at_a_time(items: list[tuple[int, Frame]]) -> None:
    wire = b"".join(
        encode_message(c, encode_frame(f.stream_id, f.type, f.data, f.flags)) for c, f in items
    )
    demux = Demultiplexer()
    out = []
    for i in range(len(wire)):
        out += demux.feed(wire[i : i + 1])
    assert out == items
    assert demux.buffered == 0


def test_many_ttrpc_frames_in_one_mux_frame_and_conns_interleaved() -> None:
    a1 = encode_frame(1, 1, b"first")
    a2 = encode_frame(3, 1, b"second")
    b1 = encode_frame(1, 2, b"reply")
    wire = mux_frame(1, a1 + a2[:4]) + mux_frame(2, b1) + mux_frame(1, a2[4:])
    assert Demultiplexer().feed(wire) == [
        (1, Frame(1, 1, 0, b"first")),
        (2, Frame(1, 2, 0, b"reply")),
        (1, Frame(3, 1, 0, b"second")),
    ]


def test_demultiplexer_counts_dropped_and_reports_buffered() -> None:
    demux = Demultiplexer()
    message = encode_frame(1, 1, b"payload")
    assert demux.feed(mux_frame(7, b"??") + mux_frame(1, message[:5]) + b"\x00\x00") == []
    assert demux.dropped_frames == 1
    assert demux.buffered == 5 + 2


@given(st.lists(st.binary(max_size=64), max_size=20))
def test_garbage_only_ever_raises_protocol_error(chunks: list[bytes]) -> None:
    demux = Demultiplexer()
    fed = 0
    try:
        for chunk in chunks:
            fed += len(chunk)
            demux.feed(chunk)
            # Held back: a partial header and at most one partial frame per connection.
            assert demux.buffered <= fed
    except ProtocolError:
        pass


@given(
    st.lists(
        st.one_of(
            st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=40)),  # any connection id
            st.tuples(st.sampled_from([1, 2]), st.binary(max_size=40)),
        ),
        max_size=12,
    ),
    st.data(),
)
def test_mux_frames_for_any_connection_with_any_payload(
    frames: list[tuple[int, bytes]], data: st.DataObject
) -> None:
    """Unknown connections are skipped and counted, whatever their payload; known ones carry
    garbage ttrpc bytes; fed whole or cut anywhere, the outcome is the same and nothing is held
    beyond a partial header and one partial ttrpc frame per connection."""
    wire = b"".join(mux_frame(conn, payload) for conn, payload in frames)
    cuts = data.draw(st.lists(st.integers(0, len(wire)), max_size=8))
    whole = Demultiplexer()
    expected = whole.feed(wire)
    pieces = Demultiplexer()
    assert feed_at(pieces, wire, cuts) == expected
    assert pieces.dropped_frames == whole.dropped_frames == sum(
        conn not in (1, 2) for conn, _ in frames)
    kept = sum(len(payload) for conn, payload in frames if conn in (1, 2))
    assert whole.buffered == pieces.buffered <= kept


def test_oversized_ttrpc_frame_is_skipped_and_the_connection_goes_on() -> None:
    demux = Demultiplexer()
    header = struct.pack(">IIBB", MAX_DATA_LENGTH + 1, 5, 1, 0)
    # As a current runtime writes it: 4096 bytes, then the rest in one mux frame.
    message = header + bytes(MAX_DATA_LENGTH + 1)
    first, rest = message[:GO_BUFFER_SIZE], message[GO_BUFFER_SIZE:]
    assert demux.feed(mux_frame(2, first)) == []
    assert demux.in_frame
    assert demux.buffered == 0
    wire = mux_frame(2, rest) + mux_frame(1, encode_frame(1, 1, b"after"))
    out = []
    for i in range(0, len(wire), 65536):
        out += demux.feed(wire[i : i + 65536])
        assert demux.buffered <= MUX_HEADER_SIZE + HEADER_SIZE + len(b"after")
    assert out == [(2, Frame(5, 1, 0, b"", oversized=MAX_DATA_LENGTH + 1)),
                   (1, Frame(1, 1, 0, b"after"))]
    assert not demux.in_frame


def test_unknown_connection_payload_is_skipped_as_it_arrives() -> None:
    demux = Demultiplexer()
    assert demux.feed(struct.pack(">II", 7, MAX_MUX_PAYLOAD)) == []
    assert demux.in_frame
    for _ in range(MAX_MUX_PAYLOAD // (1 << 20)):
        assert demux.feed(bytes(1 << 20)) == []
        assert demux.buffered == 0
    assert not demux.in_frame
    assert demux.dropped_frames == 1


def test_lost_mux_framing_poisons_the_demultiplexer() -> None:
    demux = Demultiplexer()
    with pytest.raises(ProtocolError, match=str(MAX_MUX_PAYLOAD + 1)):
        demux.feed(struct.pack(">II", 1, MAX_MUX_PAYLOAD + 1))
    with pytest.raises(ProtocolError, match="already failed"):
        demux.feed(mux_frame(1, encode_frame(1, 1, b"")))


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (10, (10,)),
        (4095, (4095,)),
        (4096, (4096,)),
        (4097, (4096, 1)),
        (9162, (4096, 5066)),
        (MAX_DATA_LENGTH + 10, (4096, MAX_DATA_LENGTH + 10 - 4096)),
    ],
)
def test_encode_message_follows_the_4096_then_rest_rule(
    size: int, expected: tuple[int, ...]
) -> None:
    message = ttrpc_message(size, stream_id=11)
    assert split_sizes(size) == expected
    wire = encode_message(RUNTIME_SERVICE_CONN, message)
    assert len(wire) == size + MUX_HEADER_SIZE * len(expected)
    mux_frames = MuxDecoder().feed(wire)
    assert [(c, len(p)) for c, p in mux_frames] == [(RUNTIME_SERVICE_CONN, n) for n in expected]
    assert b"".join(p for _, p in mux_frames) == message
    assert Demultiplexer().feed(wire) == [(2, Frame(11, 1, 0, message[10:]))]


@given(st.binary(max_size=10_000), st.sampled_from([1, 2]))
def test_encode_message_round_trips(data: bytes, conn_id: int) -> None:
    message = encode_frame(9, MessageType.RESPONSE, data)
    wire = encode_message(conn_id, message)
    frames = MuxDecoder().feed(wire)
    assert [len(p) for _, p in frames] == list(split_sizes(len(message)))
    assert Demultiplexer().feed(wire) == [(conn_id, Frame(9, 2, 0, data))]


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (b"", "at least 10 bytes"),
        (encode_frame(1, 1, b"abc")[:-1], "exactly one ttrpc frame"),
        (encode_frame(1, 1, b"abc") + encode_frame(3, 1, b""), "exactly one ttrpc frame"),
    ],
)
def test_encode_message_refuses_anything_but_one_ttrpc_frame(message: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_message(1, message)


def test_encode_message_refuses_oversize_ttrpc_frames() -> None:
    header = struct.pack(">IIBB", MAX_DATA_LENGTH + 1, 1, 1, 0)
    with pytest.raises(MessageTooLarge):
        encode_message(1, header + bytes(MAX_DATA_LENGTH + 1))


@pytest.mark.parametrize("conn_id", [0, -1, 2**32])
def test_encode_message_refuses_bad_conn_ids(conn_id: int) -> None:
    with pytest.raises(ValueError, match="connection id"):
        encode_message(conn_id, encode_frame(1, 1, b""))
