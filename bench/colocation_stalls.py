"""What the machine's tasks did while the online service stopped answering (``--trace-stalls``).

Latencies alone cannot say why a key-value service answers nothing for a second: its thread
waiting for a CPU, blocked in the kernel, the load generator that times it held up itself, or
the whole machine paused (a guest's virtual CPUs not run by its host). :class:`Sampler` runs
:mod:`bench.colocation_sampler` beside a repetition; :func:`stall_spans` finds the stalls of
the repetition in the load generator's records (requests answered ``LATE_MS`` or more after
they were due, or never) and :func:`explain` says what the samples show over each.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import colocation_sampler
from bench.colocation_report import read_pairs

LATE_MS = 300.0
"""A request answered this late or later marks a stall (what the docs count as a freeze)."""
HELD_MS = 100.0
"""A sampler interval this much longer than its median: the sampler, at real-time priority,
was held, which no ordinary task can do to it (the machine paused, or its timers were late)."""


@dataclass
class Sample:
    t_ns: int
    runnable: int
    # (name, tid) -> (state, wchan, ns on a CPU, ns waiting for one)
    threads: dict[tuple[str, int], tuple[str, str, int, int]]
    stacks: list[tuple[str, str]] = field(default_factory=list)  # (name, frames)


def read_samples(path: Path) -> list[Sample]:
    samples: list[Sample] = []
    if not path.exists():
        return samples
    for line in path.read_text().splitlines():
        if line.startswith("#stack "):
            _, _, who, *frames = line.split(" ", 3)
            if samples:
                samples[-1].stacks.append((who.rsplit("/", 1)[0], frames[0] if frames else ""))
            continue
        head, *entries = line.split("\t")
        t_ns, runnable = head.split(" ")
        threads = {}
        for entry in entries:
            name, tid, state, wchan, run, wait = entry.rsplit("/", 5)
            threads[(name, int(tid))] = (state, wchan, int(run), int(wait))
        samples.append(Sample(int(t_ns), int(runnable) if runnable.isdigit() else -1, threads))
    return samples


@dataclass(frozen=True)
class Stall:
    start_ns: int  # the due time of its first late request
    end_ns: int  # the answer (or the timeout) of its last
    silent_ns: int  # the longest time within it between two answers: a stop, or a slow queue
    # The latest a request due in it was sent (None: not recorded): the load generator's own stall.
    sent_late_ns: int | None = None


def stall_spans(service_out: Path, t0_ns: int, t1_ns: int, timeout_ms: float,
                late_ms: float = LATE_MS) -> list[Stall]:
    """The stalls (monotonic ns) of the requests due in the window: from a request answered
    ``late_ms`` or more after its due time to its answer (a missed one: to its timeout),
    overlapping ones merged; each with its longest silence. A service that stopped answers
    nothing for nearly the whole stall; one that fell behind keeps answering. Where the load
    generator recorded its sends (``<service_out>.sent``), each stall says how late it sent."""
    sent_out = Path(f"{service_out}.sent")
    sent = read_pairs(sent_out) if sent_out.exists() else None
    timeout_ns = int(timeout_ms * 1e6)
    pairs = sorted(read_pairs(service_out))
    answers = sorted(due + latency for due, latency in pairs if 0 <= latency <= timeout_ns)
    spans: list[tuple[int, int]] = []
    for due, latency in pairs:
        if not t0_ns <= due < t1_ns:
            continue
        if latency < 0 or latency > timeout_ns:
            latency = timeout_ns
        elif latency < late_ms * 1e6:
            continue
        if spans and due <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], due + latency))
        else:
            spans.append((due, due + latency))
    stalls = []
    for start, end in spans:
        marks = [start, *(a for a in answers if start < a < end), end]
        late = None if sent is None else max(
            (d for due, d in sent if start <= due <= end),
            default=0)
        stalls.append(Stall(start, end, max(b - a for a, b in itertools.pairwise(marks)), late))
    return stalls


def _within(samples: Sequence[Sample], start: int, end: int) -> list[Sample]:
    """The samples of a span, with the one just before it (the base of the CPU deltas)."""
    before = [s for s in samples if s.t_ns < start][-1:]
    return before + [s for s in samples if start <= s.t_ns <= end]


def _threads(span: Sequence[Sample]) -> Iterator[tuple[str, str]]:
    """One phrase per process name: its threads' states over the span (a count of samples
    each), the wait channels it slept in, and its ns on a CPU and waiting for one."""
    names = dict.fromkeys(name for s in span for name, _ in s.threads)
    for name in names:
        states: collections.Counter[str] = collections.Counter()
        for s in span[1:]:
            for (n, _), (state, wchan, _, _) in s.threads.items():
                if n == name:
                    states[state if state not in "DS" or wchan == "0" else f"{state}:{wchan}"] += 1
        ran = waited = 0
        for key in {k for s in span for k in s.threads if k[0] == name}:
            seen = [s.threads[key] for s in span if key in s.threads]
            ran += seen[-1][2] - seen[0][2]
            waited += seen[-1][3] - seen[0][3]
        common = ", ".join(f"{k} {v}" for k, v in states.most_common(4))
        yield name, f"{common}; ran {ran / 1e6:.0f} ms, waited for a CPU {waited / 1e6:.0f} ms"


def explain(samples: Sequence[Sample], stalls: Sequence[Stall], t0_ns: int) -> list[str]:
    """What the samples show over each stall: when and how long (s into the window) and the
    service's longest silence in it, the sampler's own largest gap (``HELD_MS`` or more past
    its median interval: the machine held it), the machine's runnable tasks, each process's
    threads (their states, a count of thread samples each), and the stacks of blocked
    threads."""
    intervals = sorted(b.t_ns - a.t_ns for a, b in itertools.pairwise(samples))
    usual = intervals[len(intervals) // 2] if intervals else 0
    lines = []
    for stall in stalls:
        start, end = stall.start_ns, stall.end_ns
        span = _within(samples, start, end)
        head = (f"stall at {(start - t0_ns) / 1e9:.1f} s for {(end - start) / 1e6:.0f} ms, "
                f"no answer for {stall.silent_ns / 1e6:.0f} ms at most")
        if stall.sent_late_ns is not None:
            head += f", requests sent up to {stall.sent_late_ns / 1e6:.0f} ms after due"
        if len(span) < 2:
            lines.append(f"{head}: no samples")
            continue
        gap = max(b.t_ns - a.t_ns for a, b in itertools.pairwise(span))
        runnable = sorted(s.runnable for s in span[1:])
        held = gap - usual
        parts = [f"{len(span) - 1} samples, largest gap {gap / 1e6:.0f} ms" + (
            f" ({held / 1e6:.0f} ms past the sampler's usual {usual / 1e6:.0f}: the machine "
            "held it)" if held >= HELD_MS * 1e6 else ""),
                 f"runnable {runnable[0]}-{runnable[-1]} (median {runnable[len(runnable) // 2]})"]
        parts += [f"{name}: {what}" for name, what in _threads(span)]
        stacks = collections.Counter(f"{n} {frames}" for s in span for n, frames in s.stacks)
        parts += [f"blocked {count}x: {stack}" for stack, count in stacks.most_common(3)]
        lines.append(f"{head}: " + " | ".join(parts))
    return lines


class Sampler:
    """The sampler script beside one repetition: started with the processes to watch, stopped
    (:meth:`close`) before its samples are read."""

    def __init__(self, out: Path, watch: dict[str, int], every_s: float = 0.2) -> None:
        self.out = out
        self._process = subprocess.Popen(
            [sys.executable, "-I", colocation_sampler.__file__, "--out", str(out), "--every",
             str(every_s),
             *(f"--watch={name}={pid}" for name, pid in watch.items())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        if self._process.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"the stall sampler did not start (exit status "
                               f"{self._process.returncode}; its error, if any, is above)")

    def add(self, name: str, pid: int) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(f"watch {name}={pid}\n")
        self._process.stdin.flush()

    def stalls(self, service_out: Path, t0_ns: int, t1_ns: int, timeout_ms: float) -> list[str]:
        """Stop sampling; each stall of the service's window (:func:`stall_spans`) explained."""
        self.close()
        return explain(read_samples(self.out), stall_spans(service_out, t0_ns, t1_ns,
                                                           timeout_ms), t0_ns)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError, subprocess.TimeoutExpired):
            self._process.communicate("stop\n", timeout=10)
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
