"""Two busy loops on one CPU, each in its own cgroup: the share of the CPU each one got, which
is what the scheduler's view of the two cgroups decides (weight, or SCHED_IDLE from cpu.idle);
and the check both real-kernel tests of the idle tier make with them.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.loops.cpu_idle import CpuIdleLoop

SPIN = ("import os\nos.sched_setaffinity(0, {int(os.environ['SPIN_CPU'])})\n"
        "print('spinning', flush=True)\nwhile True: pass\n")
Spawn = Callable[..., subprocess.Popen[Any]]
"""Starts ``argv`` inside a cgroup: ``spawn(cgroup, argv, env=..., stdout=...)``."""


def cpu_ns(pid: int) -> int:
    """The time a process has run on a CPU, in nanoseconds: the scheduler's own count from
    ``/proc/PID/schedstat``, not utime + stime, which are sampled at clock ticks."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def shares(spawn: Spawn, cgroups: Sequence[Path], seconds: float) -> list[float]:
    """One busy loop in each of ``cgroups``, all on the first CPU this process may use; each
    one's share of that CPU over ``seconds``, counted once every loop has pinned itself and
    spins (a fixed wait was not enough: in a guest under TCG an interpreter takes seconds to
    start, and loops counted before they were pinned ran on two CPUs at once)."""
    cpu = min(os.sched_getaffinity(0))
    env = {**os.environ, "SPIN_CPU": str(cpu)}
    processes = [spawn(cgroup, [sys.executable, "-I", "-c", SPIN], env=env,
                       stdout=subprocess.PIPE, text=True)
                 for cgroup in cgroups]
    try:
        for process in processes:
            assert process.stdout is not None
            if process.stdout.readline() != "spinning\n":
                raise RuntimeError(f"a busy loop ended before it spun: {process.args!r}")
        before = [cpu_ns(p.pid) for p in processes]
        began = time.monotonic()
        time.sleep(seconds)
        after = [cpu_ns(p.pid) for p in processes]
        elapsed = time.monotonic() - began
    finally:
        for process in processes:
            process.kill()
            process.communicate()
    return [(b - a) / 1e9 / elapsed for a, b in zip(before, after, strict=True)]


def idle_tier_yields(spawn: Spawn, online: Path, offline: Path, tier: Path, root: str | Path,
                     seconds: float) -> None:
    """Busy loops in ``online`` and ``offline`` share a CPU about evenly; once the agent's loop
    (reading and writing the host under ``root``) has set ``tier``'s cpu.idle, the online one
    gets more than 80 % of it and the offline one less than 25 %; when the loop closes, the
    tier's value is back."""
    assert tier.read_text().strip() == "0"
    before = shares(spawn, [online, offline], seconds)
    assert min(before) > 0.3, before  # equal weights: about half each

    cfg = Config()
    cfg = dataclasses.replace(cfg, cpu_idle=dataclasses.replace(cfg.cpu_idle, enabled=True))
    sysfs = SysFs(root, AuditLog(MemoryAuditSink()))
    loop = CpuIdleLoop(lambda: cfg, sysfs, layout_for(sysfs), StateFile(None))
    loop.cycle(0.0)
    assert tier.read_text().strip() == "1"
    online_share, offline_share = shares(spawn, [online, offline], seconds)
    assert online_share > 0.8, (online_share, offline_share)
    assert offline_share < 0.25, (online_share, offline_share)

    loop.close()
    assert tier.read_text().strip() == "0"
