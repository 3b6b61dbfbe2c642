"""Does this machine hold a real-time task, and under what load?

The colocation benchmark's guests stop answering now and then for 300 ms or more, and its stall
sampler (at real-time priority) was once held 150 ms past its period with them: the machine,
not a pod's turn at the CPU. This script asks which of the offline job's own operations, if any,
holds a real-time task on this machine. A sampler process at ``SCHED_FIFO`` (where the kernel
allows it; else the default policy, and it says so) wakes every ``--period-ms`` and records how
late each wake-up was, while this process runs one phase after another:

* ``idle``: nothing;
* ``cpu``: this process busy in Python;
* ``touch`` and ``madvise``: faulting in ``--mib`` MiB of anonymous memory, a byte a page,
  then handing all of it back in one ``madvise(MADV_DONTNEED)`` (what each offline task does),
  ``--rounds`` times;
* ``write`` and ``read`` (with ``--disk DIR``): 512 MiB written into ``DIR`` with an ``fsync``
  every 8 MiB, then, the page cache dropped (as root), read back;
* ``all``: two CPU-bound processes and, with ``--disk``, a writer with ``O_DIRECT``, beside
  ``touch`` and ``madvise`` again.

Prints, per phase, its length, the sampler's wake-ups in it, their median and largest lateness
and how many were ``--held-ms`` late or more; then the largest of the whole run.

    python bench/machine_holds.py [--mib 1536] [--rounds 3] [--disk /var/tmp] [--period-ms 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

PAGE = 4096
CHUNK = 1 << 20
DISK_MIB = 512
SYNC_EVERY = 8
"""Chunks written between two ``fsync`` calls."""

SAMPLER = """
import json, os, sys, time
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    print("fifo", flush=True)
except OSError:
    print("normal", flush=True)
period, out = float(sys.argv[1]), []
due = time.monotonic() + period
while not os.path.exists(sys.argv[2] + ".stop"):
    left = due - time.monotonic()
    if left > 0:
        time.sleep(left)
    now = time.monotonic()
    out.append((now, now - due))
    due = max(due + period, now)
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
"""
"""The sampler: a process of its own, so that this one's work never holds it by the
interpreter's lock. It stops when a file beside its output appears."""

BURNER = """
import sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
"""


@dataclass(frozen=True)
class Phase:
    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Row:
    phase: str
    seconds: float
    samples: int
    median_ms: float
    max_ms: float
    held: int


def rows(lateness: Sequence[tuple[float, float]], phases: Sequence[Phase],
         held_ms: float) -> list[Row]:
    """The sampler's wake-ups (monotonic time, seconds late) summed per phase; a phase in
    which the sampler never woke is left out."""
    found = []
    for phase in phases:
        late = [ms * 1000 for at, ms in lateness if phase.start <= at <= phase.end]
        if late:
            found.append(Row(phase.name, phase.end - phase.start, len(late),
                             statistics.median(late), max(late),
                             sum(value >= held_ms for value in late)))
    return found


def render(found: Sequence[Row], policy: str, largest_ms: float) -> str:
    lines = [f"sampler at {policy} priority; lateness of its wake-ups in ms",
             f"{'phase':12s} {'s':>7s} {'wake-ups':>9s} {'median':>7s} {'max':>8s} {'held':>5s}"]
    lines += [f"{r.phase:12s} {r.seconds:7.2f} {r.samples:9d} {r.median_ms:7.2f} "
              f"{r.max_ms:8.2f} {r.held:5d}" for r in found]
    lines.append(f"largest lateness of the run: {largest_ms:.2f} ms")
    return "\n".join(lines)


class Run:
    """The phases, timed on the monotonic clock the sampler reads."""

    def __init__(self) -> None:
        self.phases: list[Phase] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        yield
        self.phases.append(Phase(name, start, time.monotonic()))

    def memory(self, buffer: mmap.mmap, prefix: str = "") -> None:
        with self.phase(f"{prefix}touch"):
            for offset in range(0, len(buffer), PAGE):
                buffer[offset] = 1
        with self.phase(f"{prefix}madvise"):
            buffer.madvise(mmap.MADV_DONTNEED)


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def write_and_read(run: Run, directory: Path) -> None:
    path = directory / "machine-holds.bin"
    chunk = b"\xa5" * CHUNK
    try:
        with run.phase("write"), path.open("wb") as out:
            for index in range(DISK_MIB):
                out.write(chunk)
                if index % SYNC_EVERY == SYNC_EVERY - 1:
                    out.flush()
                    os.fsync(out.fileno())
        with contextlib.suppress(OSError):  # not root: read what the page cache holds
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        with run.phase("read"), path.open("rb") as source:
            while source.read(CHUNK):
                pass
    finally:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def direct_writer(directory: Path | None) -> Iterator[None]:
    """With a directory: ``dd`` writing into it past the page cache, waited for on leaving."""
    if directory is None:
        yield
        return
    path = directory / "machine-holds-direct.bin"
    writer = subprocess.Popen(["dd", "if=/dev/zero", f"of={path}", f"bs={CHUNK}",
                               f"count={DISK_MIB}", "oflag=direct"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        writer.wait()
        path.unlink(missing_ok=True)


def measure(args: argparse.Namespace, work: Callable[[Run], None]) -> str:
    """Runs ``work`` beside the sampler; the report."""
    with tempfile.TemporaryDirectory(prefix="machine-holds-") as scratch:
        out = Path(scratch) / "lateness.json"
        run = Run()
        with subprocess.Popen([sys.executable, "-c", SAMPLER, str(args.period_ms / 1000),
                               str(out)], stdout=subprocess.PIPE, text=True) as sampler:
            try:
                assert sampler.stdout is not None
                policy = sampler.stdout.readline().strip() or "no"
                work(run)
            finally:
                Path(f"{out}.stop").touch()
                status = sampler.wait(timeout=60)
        if status != 0 or not out.exists():
            raise RuntimeError(f"the sampler ended with status {status}")
        lateness = [(at, late) for at, late in json.loads(out.read_text())]
    largest = max((late * 1000 for _, late in lateness), default=0.0)
    return render(rows(lateness, run.phases, args.held_ms), policy, largest)


def phases(args: argparse.Namespace) -> Callable[[Run], None]:
    size = args.mib << 20
    disk = Path(args.disk) if args.disk else None

    def work(run: Run) -> None:
        with run.phase("idle"):
            time.sleep(args.seconds)
        with run.phase("cpu"):
            busy(args.seconds)
        with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as buffer:
            for _ in range(args.rounds):
                run.memory(buffer)
            if disk is not None:
                write_and_read(run, disk)
            others = [subprocess.Popen([sys.executable, "-c", BURNER, str(args.seconds)])
                      for _ in range(2)]
            try:
                with direct_writer(disk):
                    for _ in range(args.rounds):
                        run.memory(buffer, "all-")
            finally:
                for process in others:
                    process.wait()

    return work


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mib", type=int, default=1536, help="memory faulted in and handed back")
    parser.add_argument("--rounds", type=int, default=3, help="of touch and madvise, per part")
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="of the idle and cpu phases, and of the busy processes in 'all'")
    parser.add_argument("--disk", help="a directory to write 512 MiB into (default: no disk)")
    parser.add_argument("--period-ms", type=float, default=10.0)
    parser.add_argument("--held-ms", type=float, default=50.0,
                        help="a wake-up this late or more counts as held")
    args = parser.parse_args(argv)
    if args.mib <= 0 or args.rounds <= 0 or args.seconds <= 0 or args.period_ms <= 0:
        parser.error("--mib, --rounds, --seconds and --period-ms must be positive")
    print(measure(args, phases(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
