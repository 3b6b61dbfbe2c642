"""What the colocation benchmark says of the machine it ran on: its kernel, CPUs, memory and
memory cgroup version, and how fast it runs Python and grows memory, so that runs of different
machines can be told apart (a guest under QEMU's TCG runs 5-30 times slower than its host); and
whether a directory of it can hold a run's work directories."""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

# Steps of the loop that says how fast this machine runs Python; a scenario's timings assume a
# guest at the low end of the range above (its offline job grows its buffer at a set rate).
SPEED_STEPS = 1_000_000


def loop_ms(steps: int = SPEED_STEPS) -> float:
    """Milliseconds this process takes for ``SPEED_STEPS`` additions in a Python loop, timed
    over ``steps`` of them."""
    started = time.perf_counter()
    total = 0
    for step in range(steps):
        total += step
    return (time.perf_counter() - started) * 1000 * SPEED_STEPS / steps


TOUCH_MIB = 256


def touch_ms() -> float:
    """Milliseconds this process takes to touch ``TOUCH_MIB`` MiB of new anonymous memory, a
    write per page: the kernel's page faults and page clearing, which set how fast the offline
    job can grow its buffer (under QEMU's TCG they depend on the emulated CPU more than Python
    does)."""
    buffer = mmap.mmap(-1, TOUCH_MIB << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        started = time.perf_counter()
        for offset in range(0, TOUCH_MIB << 20, mmap.PAGESIZE):
            buffer[offset] = 1
        return (time.perf_counter() - started) * 1000
    finally:
        buffer.close()


def machine_facts(version: str, cpus: int) -> dict[str, str]:
    """What a run's header and its JSON say of the machine (``cpus``: what the run uses)."""
    meminfo = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()
    return {"kernel": os.uname().release, "cpus": str(cpus),
            "memory": f"{int(meminfo[1]) // 1024} MiB", "cgroup": version,
            "loop": f"{loop_ms():.0f} ms", "touch": f"{touch_ms():.0f} ms"}


def describe(machine: dict[str, str]) -> str:
    """The header line of a run."""
    return (f"machine: kernel {machine['kernel']}, {machine['cpus']} CPUs, {machine['memory']}; "
            f"memory cgroup {machine['cgroup']}; a loop of {SPEED_STEPS:,} Python steps takes "
            f"{machine['loop']}, touching {TOUCH_MIB} MiB of new memory {machine['touch']} "
            "(compare runs of different machines by these)")


RUNTIME_SOCKET = "nri.sock"
STATUS_SOCKET = "status.sock"
SERVICE_SOCKET = "kv.sock"
SOCKETS = (RUNTIME_SOCKET, STATUS_SOCKET, SERVICE_SOCKET)
"""The unix sockets a repetition's work directory holds: the runtime's, the agent's status
socket, the key-value service's."""


def work_prefix(mode: str, index: int) -> str:
    """A repetition's work directory's name, before the random part ``mkdtemp`` adds."""
    return f"coloc-{mode}-{index}-"


def check_work_dirs(under: Path, modes: Sequence[str], reps: int) -> None:
    """Raise ValueError, saying why, unless the work directories of a run of ``modes`` x
    ``reps`` can be made under ``under`` and hold their unix sockets: checked before any data
    is written. A directory as deep as the deepest of them is made and a socket bound in it,
    because a socket's path has at most 107 bytes and some file systems refuse sockets (a
    guest's 9p share, such as ``$NRIQOS_VM_ARTIFACTS``)."""
    prefix = max((work_prefix(mode, reps) for mode in modes), key=len)
    try:
        under.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=prefix, dir=under))
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.bind(str(probe / max(SOCKETS, key=len)))
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as exc:
        raise ValueError(
            f"{under}: a work directory there cannot hold the run's unix sockets "
            f"({exc.strerror or exc}); give a shorter directory on a local file system, "
            "e.g. /var/tmp/keep") from exc


def quiet_machine(idle_s: float) -> None:
    """Between repetitions: the page cache dropped (what a run left charged to a removed node's
    cgroup stays in memory otherwise), then an idle gap."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")
    time.sleep(idle_s)


RUN_DIRS = Path("/var/tmp")
RUN_PREFIX = "nri-qos-colocation-"


@contextlib.contextmanager
def run_dir() -> Iterator[Path]:
    """This run's scratch directory (data files, work directories), removed at the end; one
    left by a run that was killed outright is removed by the next run."""
    for old in RUN_DIRS.glob(f"{RUN_PREFIX}*"):
        pid = old.name[len(RUN_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            print(f"removed a directory left by an earlier run: {old}")
            shutil.rmtree(old, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"{RUN_PREFIX}{os.getpid()}-",
                                     dir=RUN_DIRS) as tmp:
        yield Path(tmp)


def machine_mib() -> int:
    """The machine's memory (MemTotal), MiB."""
    return int(Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1]) // 1024
