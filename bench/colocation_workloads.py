"""The two workloads of ``bench/colocation.py``, each run as a pod's container process.

Standard library only, so that what a container's memory cgroup is charged with is the workload,
not the benchmark's imports::

    python colocation_workloads.py online  --files DIR --anon-mib 64 --reads 32 --gap-ms 10 \\
                                           --out FILE
    python colocation_workloads.py offline --input FILE --output FILE --output-mib 512 \\
                                           --anon-mib 2048 --grow-mib-s 1024 --task-s 6 \\
                                           --write-every 8 --out FILE
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
* **write**: write a file of ``--mib`` MiB, flush it to disk and drop it from the page cache
  (data for the other two).

``online`` prints ``ready`` once its files are cached; both run until a line ``stop`` (or the end
of input) arrives on stdin, then print ``done`` and exit.
"""

from __future__ import annotations

import argparse
import array
import mmap
import os
import random
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
    sink = os.open(args.output, os.O_WRONLY | os.O_CREAT, 0o600)
    limit = args.anon_mib * MIB
    anon = mmap.mmap(-1, max(limit, mmap.PAGESIZE),
                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    chunk = b"\x01" * (MIB // mmap.PAGESIZE)
    block = b"\x5a" * MIB
    grown = read = written = 0
    stop = stopper()
    task = time.monotonic()
    reported = 0.0
    with open(args.out, "a") as out:
        while not stop.is_set():
            now = time.monotonic()
            if now - task >= args.task_s:  # the task is done: its buffer goes back
                anon.madvise(mmap.MADV_DONTNEED)
                grown, task = 0, now
            # Grow the task's buffer at the set rate (one MiB at a time, every page touched).
            while grown < min(limit, int((now - task) * args.grow_mib_s) * MIB):
                anon[grown:grown + MIB:mmap.PAGESIZE] = chunk
                grown += MIB
            got = len(os.read(source, MIB))
            if not got:
                os.lseek(source, 0, os.SEEK_SET)
                continue
            read += got
            if read // MIB % args.write_every == 0:
                if os.lseek(sink, 0, os.SEEK_CUR) >= args.output_mib * MIB:
                    os.lseek(sink, 0, os.SEEK_SET)
                written += os.write(sink, block)
            if now - reported >= PROGRESS_S:
                out.write(f"{time.monotonic_ns()} {read} {written} {grown}\n")
                out.flush()
                reported = now
        out.write(f"{time.monotonic_ns()} {read} {written} {grown}\n")
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
    off.add_argument("--out", required=True)
    wr = commands.add_parser("write")
    wr.add_argument("--path", required=True)
    wr.add_argument("--mib", type=int, required=True)
    args = parser.parse_args()
    {"online": online, "offline": offline, "write": write}[args.command](args)


if __name__ == "__main__":
    main()
