"""Does work on one CPU slow another CPU of this machine down?

A pod's CPU weight, its ``cpu.idle`` and its quota decide who runs on a CPU and when; none of them
decides how fast a CPU runs while another CPU is busy. Where CPUs share something underneath
(the two hyperthreads of a core, a cache, memory bandwidth; in a QEMU TCG guest, the host cores
that run the virtual CPUs and the translation between them), an offline task on one CPU slows an
online task on another, and no setting of the scheduler's sees it. This script measures it: this
process, pinned to one CPU, times a fixed Python loop while a second CPU is

* ``idle``: nothing pinned to it;
* ``spin``: a process pinned to it spins in Python;
* ``fault``: a process pinned to it faults in ``--mib`` MiB of anonymous memory, a byte a page,
  and hands it back with ``madvise(MADV_DONTNEED)``, again and again (what each offline task of
  the colocation benchmark does);

the states taking turns, ``--rounds`` times, so that a machine that drifts falls on all alike.
Prints, per state, the loop's time per million steps (median, 10th and 90th percentile) and the
median's change from ``idle``.

    python bench/cpu_interference.py [--cpus 0,1] [--rounds 12] [--samples 4] [--mib 256]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.colocation_machine import loop_ms

STATES = ("idle", "spin", "fault")
SPIN = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
print("ready", flush=True)
while True:
    pass
"""
FAULT = """
import mmap, os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
size = int(sys.argv[2]) << 20
buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
ones = b"\\x01" * (size // mmap.PAGESIZE)
print("ready", flush=True)
while True:
    buffer[::mmap.PAGESIZE] = ones
    buffer.madvise(mmap.MADV_DONTNEED)
"""
DISTURBERS = {"spin": SPIN, "fault": FAULT}


@dataclass(frozen=True)
class Row:
    state: str
    samples: int
    median_ms: float
    p10_ms: float
    p90_ms: float


def percentile(ordered: Sequence[float], share: float) -> float:
    """The nearest-rank percentile of sorted values (``share`` in 0..1)."""
    return ordered[min(int(share * len(ordered)), len(ordered) - 1)]


def row(state: str, times_ms: Sequence[float]) -> Row:
    ordered = sorted(times_ms)
    return Row(state, len(ordered), statistics.median(ordered), percentile(ordered, 0.1),
               percentile(ordered, 0.9))


def change_percent(base: float, value: float) -> float:
    return (value - base) / base * 100


def render(rows: Sequence[Row], probe: int, other: int) -> str:
    base = next(r.median_ms for r in rows if r.state == "idle")
    lines = [f"loop on CPU {probe}, CPU {other}: ms per 1M Python steps"]
    for r in rows:
        lines.append(f"  {r.state:<5} median {r.median_ms:8.1f}  p10 {r.p10_ms:8.1f}  "
                     f"p90 {r.p90_ms:8.1f}  ({change_percent(base, r.median_ms):+.0f} %, "
                     f"n={r.samples})")
    return "\n".join(lines)


def pick_cpus(allowed: set[int], wanted: str | None) -> tuple[int, int]:
    """The probe's CPU and the other: ``wanted`` ("A,B") or the two lowest allowed."""
    if wanted is None:
        if len(allowed) < 2:
            raise ValueError(f"two CPUs needed, this process may run on {sorted(allowed)}")
        first, second = sorted(allowed)[:2]
        return first, second
    parts = wanted.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--cpus {wanted!r}: two CPU numbers, as 0,1")
    probe, other = (int(p) for p in parts)
    if probe == other or not {probe, other} <= allowed:
        raise ValueError(f"--cpus {wanted!r}: two different CPUs of {sorted(allowed)}")
    return probe, other


@contextlib.contextmanager
def disturbed(state: str, cpu: int, mib: int) -> Iterator[subprocess.Popen[str] | None]:
    """The other CPU in ``state`` until the block ends: a process pinned to it, ready before
    the block starts and killed after it (none for ``idle``)."""
    if state == "idle":
        yield None
        return
    child = subprocess.Popen([sys.executable, "-c", DISTURBERS[state], str(cpu), str(mib)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {state} process on CPU {cpu} did not start "
                               f"(status {child.wait()})")
        yield child
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def measure(probe: int, other: int, rounds: int, samples: int, steps: int, mib: int,
            settle_s: float) -> list[Row]:
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {probe})
    times: dict[str, list[float]] = {s: [] for s in STATES}
    try:
        for _ in range(rounds):
            for state in STATES:
                with disturbed(state, other, mib):
                    time.sleep(settle_s)
                    times[state] += [loop_ms(steps) for _ in range(samples)]
    finally:
        os.sched_setaffinity(0, allowed)
    return [row(s, times[s]) for s in STATES]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpus", help="the probe's CPU and the other, as 0,1 (default: the "
                                       "two lowest this process may run on)")
    parser.add_argument("--rounds", type=int, default=12, help="turns of every state (12)")
    parser.add_argument("--samples", type=int, default=4, help="loops timed per turn (4)")
    parser.add_argument("--steps", type=int, default=500_000, help="steps per loop (500000)")
    parser.add_argument("--mib", type=int, default=256, help="memory faulted by 'fault' (256)")
    parser.add_argument("--settle-s", type=float, default=0.5,
                        help="wait after the other CPU changes state (0.5 s)")
    args = parser.parse_args(argv)
    for name in ("rounds", "samples", "steps", "mib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    try:
        probe, other = pick_cpus(os.sched_getaffinity(0), args.cpus)
    except ValueError as e:
        parser.error(str(e))
    rows = measure(probe, other, args.rounds, args.samples, args.steps, args.mib, args.settle_s)
    print(render(rows, probe, other))
    return 0


if __name__ == "__main__":
    sys.exit(main())
