"""A bounded memory-pressure generator, run inside a memcg by the real-kernel tests and bench.

    python pressure_worker.py <memory.failcnt (v1) or memory.events (v2) of the memcg pushed>

One command per stdin line, one JSON answer per line on stdout:

* ``write <path> <MiB>``: write a file of that size (its page cache is charged to this memcg);
* ``read <path> <seconds>``: drop the file from the page cache (so that reading it charges this
  memcg, not whichever read it before), then read it over and over for ``seconds``; the file is
  larger than the limit, so once the memcg is full every read makes the kernel reclaim clean
  page cache (cheap: a few percent of stall);
* ``dirty <path> <seconds> <MiB>``: write the file over and over (at most ``MiB`` long) for
  ``seconds``: reclaim must wait for the dirty pages' writeback (tens of percent of stall).

``read`` and ``dirty`` answer ``onset``: the CLOCK_MONOTONIC time (ns) of the start of the first
1 MiB read or write after which the memcg's failcnt moved (the limit was hit: reclaim began),
``start`` and ``end``. The pressure lasts ``seconds`` from the onset, not from the start: how long
filling the memcg up to its limit takes depends on the machine (a guest under emulation fills it
ten times slower than the host), and what is measured is the pressure, not the filling. The limit
must be reached within ``REACH_S``, or the answer's ``onset`` is null. ``quit`` ends the worker.

Only page cache is used: memory the kernel can always reclaim, so the pressure never ends in an
OOM kill, whatever the limit.
"""

from __future__ import annotations

import json
import os
import sys
import time

MIB = 1 << 20
REACH_S = 60.0


def failcnt(path: str) -> int:
    """How often the limit was hit: v1 ``memory.failcnt``, or v2 ``memory.events`` (its
    ``high`` and ``max`` counts)."""
    with open(path, "rb") as f:
        text = f.read()
    if not path.endswith("memory.events"):
        return int(text)
    counts = dict(line.split() for line in text.decode().splitlines())
    return int(counts["high"]) + int(counts["max"])


def write(path: str, mib: int) -> dict[str, object]:
    block = b"\x5a" * MIB
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return {"written_mib": mib}


def pressure(path: str, seconds: float, limit_failcnt: str, dirty_mib: int | None
             ) -> dict[str, object]:
    """``read`` (``dirty_mib`` None) or ``dirty``, as the module doc says."""
    if dirty_mib is None:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    else:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    block = b"\x3c" * MIB
    try:
        start_count = failcnt(limit_failcnt)
        onset = None
        started = time.monotonic_ns()
        deadline = started + int(REACH_S * 1e9)
        done = 0
        while time.monotonic_ns() < deadline:
            before = time.monotonic_ns()
            if dirty_mib is None:
                moved = len(os.read(fd, MIB))
                if not moved:  # the end: from the start again
                    os.lseek(fd, 0, os.SEEK_SET)
                    continue
            else:
                if os.lseek(fd, 0, os.SEEK_CUR) >= dirty_mib * MIB:  # bounded on disk
                    os.lseek(fd, 0, os.SEEK_SET)
                moved = os.write(fd, block)
            done += moved // MIB
            if onset is None and failcnt(limit_failcnt) != start_count:
                onset = before
                deadline = onset + int(seconds * 1e9)
        return {"onset": onset, "start": started, "end": time.monotonic_ns(), "mib": done}
    finally:
        os.close(fd)


def main() -> None:
    limit_failcnt = sys.argv[1]
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            return
        if words[0] == "write":
            answer = write(words[1], int(words[2]))
        elif words[0] == "read":
            answer = pressure(words[1], float(words[2]), limit_failcnt, None)
        elif words[0] == "dirty":
            answer = pressure(words[1], float(words[2]), limit_failcnt, int(words[3]))
        else:
            answer = {"error": f"unknown command {words[0]!r}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
