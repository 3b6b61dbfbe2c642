"""Throughput of the sans-IO framing layers (prints numbers; not a test).

usage: python bench/framing.py
"""

from __future__ import annotations

import time

from nri_plugin.wire.mux import Demultiplexer, encode_message
from nri_plugin.wire.ttrpc import MAX_DATA_LENGTH, FrameDecoder, MessageType, encode_frame

READ_SIZE = 65536
"""Bytes per simulated socket read."""


def wire_stream(data_size: int, total_bytes: int) -> tuple[bytes, int]:
    """Mux-framed ttrpc requests of ``data_size`` bytes each, about ``total_bytes`` in all."""
    data = bytes(data_size)
    count = max(1, total_bytes // (data_size + 10))
    wire = b"".join(
        encode_message(1, encode_frame(2 * i + 1, MessageType.REQUEST, data)) for i in range(count)
    )
    return wire, count


def decode_rate(data_size: int, total_bytes: int = 64 << 20) -> tuple[float, float]:
    """MB/s and messages/s through a Demultiplexer fed in fixed-size reads."""
    wire, count = wire_stream(data_size, total_bytes)
    reads = [wire[i : i + READ_SIZE] for i in range(0, len(wire), READ_SIZE)]
    demux = Demultiplexer()
    start = time.perf_counter()
    decoded = 0
    for chunk in reads:
        decoded += len(demux.feed(chunk))
    elapsed = time.perf_counter() - start
    assert decoded == count
    return len(wire) / elapsed / 1e6, count / elapsed


def large_frame_in_small_pieces(piece: int = 4096) -> float:
    """Seconds to reassemble one 4 MiB frame fed ``piece`` bytes at a time (linear if small)."""
    raw = encode_frame(1, MessageType.REQUEST, bytes(MAX_DATA_LENGTH))
    pieces = [raw[i : i + piece] for i in range(0, len(raw), piece)]
    decoder = FrameDecoder()
    start = time.perf_counter()
    frames = [frame for chunk in pieces for frame in decoder.feed(chunk)]
    elapsed = time.perf_counter() - start
    assert len(frames) == 1
    return elapsed


def encode_cost_us(data_size: int, calls: int = 50_000) -> float:
    """Microseconds per encode_frame + encode_message call."""
    data = bytes(data_size)
    start = time.perf_counter()
    for i in range(calls):
        encode_message(2, encode_frame(2 * i + 1, MessageType.RESPONSE, data))
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    for size in (1024, 100 * 1024):
        mb_s, msg_s = decode_rate(size)
        print(f"decode {size // 1024:>4} KiB messages: {mb_s:8.1f} MB/s  {msg_s:10.0f} msg/s")
    print(f"4 MiB frame fed in 4 KiB pieces: {large_frame_in_small_pieces() * 1e3:.1f} ms")
    print(f"4 MiB frame fed in 64 KiB pieces: {large_frame_in_small_pieces(65536) * 1e3:.1f} ms")
    for size in (100, 1024, 9152, 100 * 1024):
        print(f"encode_frame+encode_message, {size:>6} B data: {encode_cost_us(size):6.2f} us/call")


if __name__ == "__main__":
    main()
