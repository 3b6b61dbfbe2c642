"""ttrpc framing and stream-id rules."""

from __future__ import annotations

import re
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nri_plugin.wire.errors import MessageTooLarge, StreamIdsExhausted
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.ttrpc import (
    HEADER_SIZE,
    MAX_DATA_LENGTH,
    MAX_STREAM_ID,
    ClientStreams,
    Frame,
    FrameDecoder,
    MessageType,
    ServerStreams,
    encode_frame,
)

frames_st = st.builds(
    Frame,
    stream_id=st.integers(0, MAX_STREAM_ID),
    type=st.integers(0, 255),
    flags=st.integers(0, 255),
    data=st.binary(max_size=3000),
)


def encode(frame: Frame) -> bytes:
    return encode_frame(frame.stream_id, frame.type, frame.data, frame.flags)


def feed_in_pieces(decoder: FrameDecoder, data: bytes, cuts: list[int]) -> list[Frame]:
    out: list[Frame] = []
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        out += decoder.feed(data[start:cut])
        start = cut
    return out


def test_constants_and_enums() -> None:
    assert HEADER_SIZE == 10
    assert MAX_DATA_LENGTH == 4_194_304
    assert [int(t) for t in MessageType] == [1, 2, 3]
    assert [int(c) for c in StatusCode] == list(range(17))
    assert StatusCode(8) is StatusCode.RESOURCE_EXHAUSTED
    assert StatusCode(12) is StatusCode.UNIMPLEMENTED
    assert StatusCode(16) is StatusCode.UNAUTHENTICATED


def test_encode_frame_layout() -> None:
    raw = encode_frame(0x01020304, MessageType.RESPONSE, b"\x0a\x00", flags=0x05)
    assert raw == bytes.fromhex("00000002 01020304 02 05 0a00")


def test_decode_bytes_seen_on_the_wire() -> None:
    # From a containerd 2.4 recording: the runtime's empty RegisterPlugin response,
    # then the plugin's ConfigureResponse (payload events=0xd, no status = OK).
    raw = bytes.fromhex("00000000 00000001 02 00  00000004 00000001 02 00 1202100d")
    assert FrameDecoder().feed(raw) == [
        Frame(1, MessageType.RESPONSE, 0, b""),
        Frame(1, MessageType.RESPONSE, 0, bytes.fromhex("1202100d")),
    ]


def test_empty_data_is_a_frame() -> None:
    assert FrameDecoder().feed(encode_frame(7, MessageType.REQUEST, b"")) == [Frame(7, 1, 0, b"")]


@given(st.lists(frames_st, max_size=6), st.data())
def test_round_trip_any_split(frames: list[Frame], data: st.DataObject) -> None:
    stream = b"".join(encode(f) for f in frames)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    whole = FrameDecoder()
    assert whole.feed(stream) == frames
    assert whole.buffered == 0
    assert feed_in_pieces(FrameDecoder(), stream, cuts) == frames


@given(st.lists(frames_st, min_size=1, max_size=3))
def test_one_byte_at_a_time_matches_whole(frames: list[Frame]) -> None:
    stream = b"".join(encode(f) for f in frames)
    decoder = FrameDecoder()
    out: list[Frame] = []
    for i in range(len(stream)):
        out += decoder.feed(stream[i : i + 1])
    assert out == FrameDecoder().feed(stream) == frames


@pytest.mark.parametrize("size", [4086, 4087, 9152, MAX_DATA_LENGTH - 1, MAX_DATA_LENGTH])
def test_large_frames_round_trip_in_4k_pieces(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + b"\x7f" * (size % 256)
    raw = encode_frame(3, MessageType.REQUEST, payload) + encode_frame(5, MessageType.REQUEST, b"x")
    decoder = FrameDecoder()
    out: list[Frame] = []
    for i in range(0, len(raw), 4096):
        out += decoder.feed(raw[i : i + 4096])
    assert out == [Frame(3, 1, 0, payload), Frame(5, 1, 0, b"x")]
    assert decoder.buffered == 0


def test_partial_frame_stays_buffered() -> None:
    raw = encode_frame(1, MessageType.REQUEST, b"abcdef")
    decoder = FrameDecoder()
    assert decoder.feed(raw[:12]) == []
    assert decoder.buffered == 12
    assert decoder.feed(raw[12:]) == [Frame(1, 1, 0, b"abcdef")]


def test_unknown_message_types_are_decoded_not_rejected() -> None:
    assert FrameDecoder().feed(encode_frame(1, 0x7E, b"?")) == [Frame(1, 0x7E, 0, b"?")]


def oversized(stream_id: int, length: int = MAX_DATA_LENGTH + 1) -> bytes:
    """A frame announcing ``length`` bytes of data, with that many bytes after it."""
    return struct.pack(">IIBB", length, stream_id, MessageType.REQUEST, 0) + bytes(length)


def test_oversize_frame_is_skipped_without_being_held() -> None:
    raw = oversized(9) + encode_frame(11, MessageType.REQUEST, b"next")
    decoder = FrameDecoder()
    # The header, one byte at a time: nothing comes out, the decoder is inside a frame.
    for i in range(HEADER_SIZE):
        assert decoder.feed(raw[i : i + 1]) == []
        assert decoder.in_frame
    # The data goes by without being kept.
    out: list[Frame] = []
    for i in range(HEADER_SIZE, len(raw), 65536):
        out += decoder.feed(raw[i : i + 65536])
        assert decoder.buffered <= HEADER_SIZE + len(b"next")
    assert out == [Frame(9, MessageType.REQUEST, 0, b"", oversized=MAX_DATA_LENGTH + 1),
                   Frame(11, MessageType.REQUEST, 0, b"next")]
    assert not decoder.in_frame


def test_maximum_length_header_is_accepted() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(struct.pack(">IIBB", MAX_DATA_LENGTH, 1, 1, 0)) == []
    assert decoder.buffered == HEADER_SIZE
    assert decoder.feed(bytes(MAX_DATA_LENGTH)) == [Frame(1, 1, 0, bytes(MAX_DATA_LENGTH))]


def test_oversize_after_good_frames_in_same_feed() -> None:
    raw = encode_frame(1, 1, b"ok") + struct.pack(">IIBB", 0xFFFFFFFF, 3, 1, 0) + b"skipped"
    decoder = FrameDecoder()
    assert decoder.feed(raw) == [Frame(1, 1, 0, b"ok")]
    assert decoder.buffered == 0
    assert decoder.in_frame


@given(st.lists(st.binary(max_size=64), max_size=20))
def test_garbage_never_raises_and_holds_at_most_one_frame(chunks: list[bytes]) -> None:
    decoder = FrameDecoder()
    fed = 0
    for chunk in chunks:
        fed += len(chunk)
        for frame in decoder.feed(chunk):
            assert len(frame.data) <= MAX_DATA_LENGTH
            assert frame.oversized == 0 or frame.data == b""
        assert decoder.buffered <= min(fed, HEADER_SIZE + MAX_DATA_LENGTH)


@given(st.lists(frames_st, max_size=4), st.data())
def test_truncated_stream_yields_the_whole_frames_and_stays_in_frame(
    frames: list[Frame], data: st.DataObject
) -> None:
    stream = b"".join(encode(f) for f in frames)
    cut = data.draw(st.integers(0, len(stream)))
    decoder = FrameDecoder()
    out = decoder.feed(stream[:cut])
    assert out == frames[: len(out)]
    whole = sum(len(encode(f)) for f in out)
    assert decoder.buffered == cut - whole
    assert decoder.in_frame == (cut > whole)


def test_encode_refuses_oversize_data_locally() -> None:
    encode_frame(1, 1, bytes(MAX_DATA_LENGTH))
    with pytest.raises(MessageTooLarge, match="4194305 bytes exceeds") as info:
        encode_frame(1, 1, bytes(MAX_DATA_LENGTH + 1))
    assert (info.value.length, info.value.limit) == (MAX_DATA_LENGTH + 1, MAX_DATA_LENGTH)


@pytest.mark.parametrize(
    ("stream_id", "msg_type", "flags", "match"),
    [
        (-1, 1, 0, "stream id -1"),
        (2**32, 1, 0, "stream id 4294967296"),
        (1, 256, 0, "message type 256"),
        (1, -1, 0, "message type -1"),
        (1, 1, 256, "flags 256"),
    ],
)
def test_encode_rejects_out_of_range_header_fields(
    stream_id: int, msg_type: int, flags: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        encode_frame(stream_id, msg_type, b"", flags)


def test_client_stream_ids_are_odd_and_increasing() -> None:
    streams = ClientStreams()
    assert [streams.open() for _ in range(4)] == [1, 3, 5, 7]
    assert streams.pending == 4
    assert streams.close(3) is True
    assert streams.close(3) is False  # already finished: the late response is dropped
    assert streams.close(9) is False  # never opened
    assert streams.close(2) is False
    assert streams.pending == 3
    assert streams.open() == 9  # closing never frees an id for reuse


def test_client_stream_ids_exhaust_at_32_bits() -> None:
    streams = ClientStreams(first_id=MAX_STREAM_ID - 2)
    assert streams.open() == MAX_STREAM_ID - 2
    assert streams.open() == MAX_STREAM_ID
    with pytest.raises(StreamIdsExhausted):
        streams.open()
    assert streams.pending == 2


@pytest.mark.parametrize("first_id", [0, 2, -1, 2**32 + 1])
def test_client_first_id_must_be_a_valid_odd_id(first_id: int) -> None:
    with pytest.raises(ValueError, match="odd"):
        ClientStreams(first_id=first_id)


def test_server_accepts_odd_increasing_ids_that_skip() -> None:
    streams = ServerStreams()
    assert streams.accept(1) is None
    assert streams.accept(5) is None  # 3 never arrived: allowed
    assert streams.accept(7) is None


@pytest.mark.parametrize(
    ("sequence", "bad", "match"),
    [
        ([], 0, "stream id 0 is even"),
        ([1], 2, "stream id 2 is even"),
        ([1], 1, r"stream id 1 is not greater than the last one \(1\)"),
        ([1, 7], 5, r"stream id 5 is not greater than the last one \(7\)"),
    ],
)
def test_server_rejects_bad_ids(sequence: list[int], bad: int, match: str) -> None:
    streams = ServerStreams()
    for stream_id in sequence:
        assert streams.accept(stream_id) is None
    message = streams.rejection_message(bad)
    assert message is not None
    assert re.search(match, message)
    assert streams.accept(bad) is StatusCode.INVALID_ARGUMENT


def test_server_rejection_does_not_advance_last_id() -> None:
    streams = ServerStreams()
    assert streams.accept(3) is None
    assert streams.accept(8) is StatusCode.INVALID_ARGUMENT
    assert streams.accept(5) is None
    assert streams.rejection_message(7) is None
