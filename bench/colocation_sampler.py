"""The stall sampler of the colocation benchmark (``--trace-stalls``), run as a script beside
one repetition (:class:`bench.colocation_stalls.Sampler` starts it). Standard library only, so
that it starts small and reads nothing of the benchmark's.

Every ``--every`` seconds, at real-time priority where the kernel allows it (so that the CPU
contention it looks for does not delay it), it reads:

* each thread of each ``--watch NAME=PID`` process: its state, its kernel wait channel and its
  schedstat (ns on a CPU, ns runnable and waiting for one);
* the kernel threads whose names start with one of ``--kthreads`` (PSI's ``psimon``,
  ``kswapd``, ``kcompactd``), looked up again every few seconds;
* the machine's runnable task count (``/proc/loadavg``);
* the kernel stack of every watched thread in uninterruptible sleep (``D``).

When it stops, one line per sample goes to ``--out``: ``<monotonic ns> <runnable>`` then,
tab-separated, ``NAME/TID/STATE/WCHAN/RUN_NS/WAIT_NS`` per thread; a stack is a line of its
own, ``#stack <monotonic ns> NAME/TID <frame;frame;...>``. A line ``watch NAME=PID`` on its
input adds a process; a line ``stop``, or the end of its input, stops it.

    python colocation_sampler.py --out FILE [--every 0.2] --watch service=PID [--watch ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Sequence

KTHREADS = ("psimon", "kswapd", "kcompactd")
RESCAN_S = 5.0
"""How often the kernel threads are looked up again: ``psimon`` starts with the first trigger."""


def read(path: str) -> str:
    """The text of a /proc file in three system calls (``open()`` takes more, and the sampler
    makes a few hundred reads a second)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # the thread ended between listing and reading
        return ""
    try:
        return os.read(fd, 65536).decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def kernel_threads(prefixes: Sequence[str]) -> dict[int, str]:
    """The kernel threads named with one of ``prefixes``: children of kthreadd (pid 2)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            status = read(f"/proc/{entry}/stat")
            after = status[status.rfind(")") + 2:].split()
            if len(after) < 2 or after[1] != "2":
                continue
            comm = status[status.find("(") + 1:status.rfind(")")]
            if comm.startswith(tuple(prefixes)):
                found[int(entry)] = comm
    return found


def thread_entry(name: str, task: str) -> tuple[str, str] | None:
    """``NAME/TID/STATE/WCHAN/RUN_NS/WAIT_NS`` of one thread (``task``: its /proc directory),
    and its state; None once the thread is gone (its CPU times would read as zero)."""
    stat = read(f"{task}/stat")
    schedstat = read(f"{task}/schedstat").split()
    if not stat or len(schedstat) < 2:
        return None
    state = stat[stat.rfind(")") + 2:stat.rfind(")") + 3]
    wchan = (read(f"{task}/wchan").strip() or "0") if state in ("D", "S") else "0"
    return f"{name}/{task.rsplit('/', 1)[1]}/{state}/{wchan}/{schedstat[0]}/{schedstat[1]}", state


def sample(watch: dict[str, int], kthreads: dict[int, str]) -> list[str]:
    now = time.monotonic_ns()
    loadavg = read("/proc/loadavg").split()
    runnable = loadavg[3].split("/")[0] if len(loadavg) > 3 else "?"
    entries, stacks = [], []
    tasks = [(name, f"/proc/{pid}/task/{tid}") for name, pid in list(watch.items())
             for tid in _listdir(f"/proc/{pid}/task")]
    tasks += [(comm, f"/proc/{pid}/task/{pid}") for pid, comm in kthreads.items()]
    for name, task in tasks:
        if (seen := thread_entry(name, task)) is None:
            continue
        entry, state = seen
        entries.append(entry)
        if state == "D":
            frames = [line.split(" ", 1)[-1].split("+")[0]
                      for line in read(f"{task}/stack").splitlines()]
            stacks.append(f"#stack {now} {name}/{task.rsplit('/', 1)[1]} {';'.join(frames)}")
    return ["\t".join([f"{now} {runnable}", *entries]), *stacks]


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    p.add_argument("--watch", action="append", default=[], metavar="NAME=PID")
    p.add_argument("--kthreads", default=",".join(KTHREADS))
    args = p.parse_args(argv)
    watch = {name: int(pid) for name, pid in (w.split("=", 1) for w in args.watch)}
    prefixes = tuple(k for k in args.kthreads.split(",") if k)
    with contextlib.suppress(OSError):  # not allowed: sampled at normal priority
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    stop = threading.Event()

    def watch_input() -> None:
        for line in sys.stdin:
            if line.startswith("watch "):
                name, pid = line.split(" ", 1)[1].strip().split("=", 1)
                watch[name] = int(pid)
            elif line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=watch_input, daemon=True).start()
    kthreads, scanned = kernel_threads(prefixes), time.monotonic()
    print("ready", flush=True)
    # Kept in memory until the end: a write to a disk the offline pods keep busy can block
    # (dirty page throttling), and the sampler would stall beside what it watches.
    lines: list[str] = []
    while not stop.wait(args.every):
        if time.monotonic() - scanned >= RESCAN_S:
            kthreads, scanned = kernel_threads(prefixes), time.monotonic()
        lines += sample(watch, kthreads)
    with open(args.out, "a") as out:
        out.write("".join(f"{line}\n" for line in lines))
    print("done", flush=True)


if __name__ == "__main__":
    main()
