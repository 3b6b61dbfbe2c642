"""Two busy loops on one CPU, each in its own cgroup: the share of the CPU each one got, which
is what the scheduler's view of the two cgroups decides (weight, or SCHED_IDLE from cpu.idle).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SPIN = "import os\nos.sched_setaffinity(0, {int(os.environ['SPIN_CPU'])})\nwhile True: pass\n"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def shares(spawn: Callable[..., subprocess.Popen[Any]], cgroups: Sequence[Path],
           seconds: float) -> list[float]:
    """One busy loop in each of ``cgroups``, all on the first CPU this process may use
    (``spawn(cgroup, argv, env=...)`` starts a process inside a cgroup); each one's share of
    that CPU over ``seconds``, after the loops have started."""
    cpu = min(os.sched_getaffinity(0))
    env = {**os.environ, "SPIN_CPU": str(cpu)}
    processes = [spawn(cgroup, [sys.executable, "-I", "-c", SPIN], env=env)
                 for cgroup in cgroups]
    try:
        time.sleep(0.5)  # started and pinned
        ended = [p.args for p in processes if p.poll() is not None]
        if ended:
            raise RuntimeError(f"a busy loop ended at once: {ended}")
        before = [cpu_ticks(p.pid) for p in processes]
        began = time.monotonic()
        time.sleep(seconds)
        after = [cpu_ticks(p.pid) for p in processes]
        elapsed = time.monotonic() - began
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return [(b - a) / TICKS / elapsed for a, b in zip(before, after, strict=True)]
