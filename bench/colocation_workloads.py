"""The two workloads of ``bench/colocation.py``, each run as a pod's container process.

Standard library only, so that what a container's memory cgroup is charged with is the workload,
not the benchmark's imports::

    python colocation_workloads.py online  --files DIR --anon-mib 64 --reads 32 --gap-ms 10 \\
                                           --out FILE
    python colocation_workloads.py offline --input FILE --output FILE --output-mib 512 \\
                                           --anon-mib 2048 --grow-mib-s 1024 --task-s 6 \\
                                           --write-every 8 [--warm] --out FILE
    python colocation_workloads.py serve   --files DIR --anon-mib 64 --reads 4 --socket PATH
    python colocation_workloads.py load    --socket PATH --rps 200 --timeout-ms 1000 --out FILE
    python colocation_workloads.py write   --path FILE --mib N

* **online**: fixed work per iteration: write one byte into every page of its own anonymous
  working set, then ``--reads`` reads of 64 KiB at random offsets of a set of files read through
  the page cache (first dropped from the cache and read whole, so that this container is charged
  for them), then sleep ``--gap-ms``. Every iteration's start and duration (CLOCK_MONOTONIC,
  ns) are appended to ``--out`` as pairs of signed 64-bit integers, once a second.
* **offline**: a batch job running one task after another, each ``--task-s`` long. It streams
  ``--input`` (dropped from the cache first, read 1 MiB at a time, from the start again at its
  end) and writes 1 MiB to ``--output`` every ``--write-every`` MiB read (the output wraps at
  ``--output-mib``: dirty page cache, bounded on disk); each task grows an anonymous working
  set (a sort or shuffle buffer) by ``--grow-mib-s`` up to ``--anon-mib`` while it streams,
  and frees it when it ends. Four times a second it appends ``<monotonic ns> <bytes read>
  <bytes written> <anonymous bytes>`` to ``--out``.
  Each MiB read is checksummed ``--work-rounds`` times (SHA-256: the job's CPU work per MiB);
  the progress line also carries ``<bytes checksummed> <CPU ns spent checksumming>``.
  With ``--warm`` it first reads ``--input`` through once, unchecked and uncounted: the node's
  page cache as a job that has streamed for a while leaves it.
* **serve**: a key-value server on a unix socket: values live in its own anonymous memory
  (``--anon-mib``, in slots of ``--value-kib``) and in a file set read through the page cache.
  A request is a key (8 bytes, little-endian); serving it writes one byte into every page of
  the key's slot and reads ``--reads`` blocks of ``--value-kib`` from the files at offsets the
  key chooses; the answer is the key. One connection at a time, requests answered in order.
* **load**: an open-loop load generator for ``serve``: request ``i`` is due at ``start + i /
  --rps`` and is sent then whatever came back before (a slow server queues requests, it does
  not slow the arrivals); each request's latency is measured from its due time to its answer.
  A request not answered within ``--timeout-ms`` (or not at all: the server gone) is a miss.
  At the end it appends ``(due ns, latency ns)`` pairs (signed 64-bit; latency -1 for a miss)
  to ``--out`` and, with ``--sent FILE``, ``(due ns, ns from then to its send)`` pairs to FILE:
  a stall of the load generator itself shows there, not as the service's.
* **write**: write a file of ``--mib`` MiB, flush it to disk and drop it from the page cache
  (data for the others).

``online`` and ``serve`` print ``ready`` once their files are cached, ``offline`` once its job
starts (after the read of ``--warm``), ``load`` once it is connected; all but ``write`` run
until a line ``stop`` (or the end of input) arrives on stdin, then print ``done`` and exit.
"""

from __future__ import annotations

import argparse
import array
import collections
import contextlib
import hashlib
import mmap
import os
import random
import socket
import struct
import sys
import threading
import time
from pathlib import Path

MIB = 1 << 20
READ_BYTES = 64 << 10
PROGRESS_S = 0.25
FLUSH_S = 1.0


def uncache(path: Path) -> None:
    """Drop a file's clean page cache, whoever it is charged to: whoever reads it next pays."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def stopper() -> threading.Event:
    """Set once ``stop`` or the end of input arrives on stdin."""
    stop = threading.Event()

    def watch() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    return stop


def say(word: str) -> None:
    sys.stdout.write(word + "\n")
    sys.stdout.flush()


def online(args: argparse.Namespace) -> None:
    pages = args.anon_mib * MIB // mmap.PAGESIZE
    anon = mmap.mmap(-1, pages * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    ones = b"\x01" * pages
    anon[::mmap.PAGESIZE] = ones
    files = sorted(p for p in Path(args.files).iterdir() if p.is_file())
    fds = []
    for path in files:
        uncache(path)
        fd = os.open(path, os.O_RDONLY)
        while os.read(fd, MIB):
            pass
        fds.append((fd, os.fstat(fd).st_size // READ_BYTES))
    rnd = random.Random(15)
    stop = stopper()
    samples = array.array("q")
    flushed = time.monotonic()
    with open(args.out, "ab") as out:
        say("ready")
        while not stop.is_set():
            start = time.monotonic_ns()
            anon[::mmap.PAGESIZE] = ones
            for _ in range(args.reads):
                fd, blocks = fds[rnd.randrange(len(fds))]
                os.pread(fd, READ_BYTES, rnd.randrange(blocks) * READ_BYTES)
            samples.append(start)
            samples.append(time.monotonic_ns() - start)
            if time.monotonic() - flushed >= FLUSH_S:
                samples.tofile(out)
                out.flush()
                del samples[:]
                flushed = time.monotonic()
            time.sleep(args.gap_ms / 1000)
        samples.tofile(out)
    say("done")


def offline(args: argparse.Namespace) -> None:
    uncache(Path(args.input))
    source = os.open(args.input, os.O_RDONLY)
    if args.warm:
        # Read through once, nothing checksummed or counted: the page cache a job that has
        # streamed its data set for a while leaves on the node.
        while os.read(source, MIB):
            pass
        os.lseek(source, 0, os.SEEK_SET)
    sink = os.open(args.output, os.O_WRONLY | os.O_CREAT, 0o600)
    limit = args.anon_mib * MIB
    anon = mmap.mmap(-1, max(limit, mmap.PAGESIZE),
                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    chunk = b"\x01" * (MIB // mmap.PAGESIZE)
    block = b"\x5a" * MIB
    grown = read = written = checked = work_ns = 0
    stop = stopper()
    task = time.monotonic()
    reported = 0.0
    with open(args.out, "a") as out:
        say("ready")
        while not stop.is_set():
            now = time.monotonic()
            if now - task >= args.task_s:  # the task is done: its buffer goes back
                anon.madvise(mmap.MADV_DONTNEED)
                grown, task = 0, now
            # Grow the task's buffer at the set rate (one MiB at a time, every page touched).
            while grown < min(limit, int((now - task) * args.grow_mib_s) * MIB):
                anon[grown:grown + MIB:mmap.PAGESIZE] = chunk
                grown += MIB
            data = os.read(source, MIB)
            got = len(data)
            if not got:
                os.lseek(source, 0, os.SEEK_SET)
                continue
            read += got
            began = time.thread_time_ns()
            for _ in range(args.work_rounds):
                hashlib.sha256(data).digest()
            work_ns += time.thread_time_ns() - began
            checked += got
            if read // MIB % args.write_every == 0:
                if os.lseek(sink, 0, os.SEEK_CUR) >= args.output_mib * MIB:
                    os.lseek(sink, 0, os.SEEK_SET)
                written += os.write(sink, block)
            if now - reported >= PROGRESS_S:
                out.write(f"{time.monotonic_ns()} {read} {written} {grown} {checked} {work_ns}\n")
                out.flush()
                reported = now
        out.write(f"{time.monotonic_ns()} {read} {written} {grown} {checked} {work_ns}\n")
    say("done")


KEY = struct.Struct("<Q")
MISS = -1


def arrival_ns(start_ns: int, rps: float, i: int) -> int:
    """When request ``i`` of an open-loop load at ``rps`` is due."""
    return start_ns + round(i * 1e9 / rps)


def count_misses(latencies_ns: list[int], timeout_ns: int) -> int:
    """Requests not answered (``MISS``) or answered after ``timeout_ns``."""
    return sum(1 for v in latencies_ns if v == MISS or v > timeout_ns)


def block_offsets(key: int, reads: int, blocks: int) -> list[int]:
    """The blocks of the file set a key's request reads (a cheap hash: same key, same blocks)."""
    return [((key + 1) * 0x9E3779B97F4A7C15 + r * 0xBF58476D1CE4E5B9) % (1 << 64) % blocks
            for r in range(reads)]


def serve(args: argparse.Namespace) -> None:
    value = args.value_kib * 1024
    slots = max(args.anon_mib * MIB // value, 1)
    anon = mmap.mmap(-1, slots * value, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anon[::mmap.PAGESIZE] = b"\x01" * (slots * value // mmap.PAGESIZE)
    ones = b"\x02" * max(value // mmap.PAGESIZE, 1)
    fds = []
    for path in sorted(p for p in Path(args.files).iterdir() if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        while os.read(fd, MIB):
            pass
        fds.append((fd, max(os.fstat(fd).st_size // value, 1)))
    blocks = sum(n for _, n in fds)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(args.socket)
    server.listen(4)
    server.settimeout(0.2)
    stop = stopper()
    say("ready")
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(0.2)
        pending = b""
        with conn:
            while not stop.is_set():
                try:
                    got = conn.recv(65536)
                except TimeoutError:
                    continue
                if not got:
                    break
                pending += got
                whole = len(pending) // KEY.size * KEY.size
                answers = []
                for (key,) in KEY.iter_unpack(pending[:whole]):
                    slot = key % slots * value
                    anon[slot:slot + value:mmap.PAGESIZE] = ones
                    for block in block_offsets(key, args.reads, blocks):
                        for fd, n in fds:
                            if block < n:
                                os.pread(fd, value, block * value)
                                break
                            block -= n
                    answers.append(KEY.pack(key))
                pending = pending[whole:]
                with contextlib.suppress(OSError):
                    conn.sendall(b"".join(answers))
    server.close()
    say("done")


def load(args: argparse.Namespace) -> None:
    timeout_ns = int(args.timeout_ms * 1e6)
    stop = stopper()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(args.socket)
    lock = threading.Lock()
    due: collections.deque[int] = collections.deque()  # sent, not answered, in order
    done: list[tuple[int, int]] = []
    sent = array.array("q")  # with --sent: (due ns, ns after it the request was sent)

    def receive() -> None:
        buffer = b""
        while True:
            try:
                got = conn.recv(65536)
            except OSError:
                return
            if not got:
                return
            now = time.monotonic_ns()
            buffer += got
            with lock:
                for _ in range(len(buffer) // KEY.size):
                    at = due.popleft()
                    done.append((at, now - at))
            buffer = buffer[len(buffer) // KEY.size * KEY.size:]

    reader = threading.Thread(target=receive, daemon=True)
    reader.start()
    start = time.monotonic_ns() + 20_000_000
    i = 0
    gone = False
    say("ready")
    while not stop.is_set():
        at = arrival_ns(start, args.rps, i)
        wait = at - time.monotonic_ns()
        if wait > 0:
            stop.wait(wait / 1e9)
            if stop.is_set():
                break
        if gone:
            done.append((at, MISS))  # the server is gone: due, never answered
        else:
            with lock:
                due.append(at)
            try:
                conn.sendall(KEY.pack(i))
            except OSError:
                gone = True
            if args.sent:
                sent.extend((at, time.monotonic_ns() - at))
        i += 1
    # the last answers, up to the timeout; what is still out is missed
    deadline = time.monotonic_ns() + timeout_ns
    while time.monotonic_ns() < deadline and reader.is_alive():
        with lock:
            if not due:
                break
        time.sleep(0.01)
    conn.close()
    with lock:
        done.extend((at, MISS) for at in due)
        done.sort()
        out = array.array("q", [v for pair in done for v in pair])
    with open(args.out, "ab") as f:
        out.tofile(f)
    if args.sent:
        with open(args.sent, "ab") as f:
            sent.tofile(f)
    say("done")


def write(args: argparse.Namespace) -> None:
    block = b"\xa5" * MIB
    with open(args.path, "wb") as f:
        for _ in range(args.mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    uncache(Path(args.path))
    say("done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    on = commands.add_parser("online")
    on.add_argument("--files", required=True)
    on.add_argument("--anon-mib", type=int, default=64)
    on.add_argument("--reads", type=int, default=32)
    on.add_argument("--gap-ms", type=float, default=10.0)
    on.add_argument("--out", required=True)
    off = commands.add_parser("offline")
    off.add_argument("--input", required=True)
    off.add_argument("--output", required=True)
    off.add_argument("--output-mib", type=int, default=512)
    off.add_argument("--anon-mib", type=int, default=2048)
    off.add_argument("--grow-mib-s", type=float, default=1024.0)
    off.add_argument("--task-s", type=float, default=6.0)
    off.add_argument("--write-every", type=int, default=8)
    off.add_argument("--work-rounds", type=int, default=1)
    off.add_argument("--warm", action="store_true",
                     help="read the data set through once before the job starts")
    off.add_argument("--out", required=True)
    sv = commands.add_parser("serve")
    sv.add_argument("--files", required=True)
    sv.add_argument("--anon-mib", type=int, default=64)
    sv.add_argument("--value-kib", type=int, default=16)
    sv.add_argument("--reads", type=int, default=4)
    sv.add_argument("--socket", required=True)
    ld = commands.add_parser("load")
    ld.add_argument("--socket", required=True)
    ld.add_argument("--rps", type=float, default=200.0)
    ld.add_argument("--timeout-ms", type=float, default=1000.0)
    ld.add_argument("--out", required=True)
    ld.add_argument("--sent", help="also record when each request was sent")
    wr = commands.add_parser("write")
    wr.add_argument("--path", required=True)
    wr.add_argument("--mib", type=int, required=True)
    args = parser.parse_args()
    {"online": online, "offline": offline, "serve": serve, "load": load,
     "write": write}[args.command](args)


if __name__ == "__main__":
    main()
