"""The agent's view of this machine, with its memory cgroups confined to one child memcg.

A :class:`RealRoot` is a directory to use as ``reconciler.root``: its ``/proc``, ``/sys/devices``
and ``/sys/kernel`` are the machine's (symbolic links), while its ``/sys/fs/cgroup/memory`` is a
fresh child memcg of the machine's cgroup v1 memory hierarchy, with a limit; on a cgroup v2
machine without the v1 memory controller, its whole ``/sys/fs/cgroup`` is a fresh child cgroup
of the v2 hierarchy (its ``memory.max`` the limit, memory passed down to its children). The
agent's code runs unchanged: it finds kubelet's layout (``kubepods``, ``kubepods/burstable``,
``kubepods/besteffort``) in that memcg, its "root memcg" is the child (whose limit stands for the
node's memory), and everything it writes stays inside. Processes are put into the memcgs as pods'
containers would be.

Needs root and the cgroup v1 memory controller (:func:`unavailable` says why not); every memcg
and process made is removed by :meth:`RealRoot.close`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.kubelet_node import remove_cgroup
from reconciler.host.parse import parse_counters

MEMORY_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
WORKER = Path(__file__).with_name("pressure_worker.py")
MIB = 1 << 20


def in_cgroup(cgroup: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped so that it starts inside ``cgroup``: the shell moves itself there before
    it execs, so the process runs no code of its own outside it."""
    return ["/bin/sh", "-c", 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"', "sh",
            str(cgroup), *argv]


def unavailable() -> str:
    """Why the real-kernel memory tests cannot run here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root"
    if not (MEMORY_V1 / "memory.limit_in_bytes").is_file():
        return "needs the cgroup v1 memory controller at /sys/fs/cgroup/memory"
    return ""


def unavailable_any() -> str:
    """Why no :class:`RealRoot` of either cgroup version can be made here ("" when one can)."""
    if not unavailable() or not v2_unavailable():
        return ""
    return f"{unavailable()}; or a cgroup v2 root with memory: {v2_unavailable()}"


def v2_unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root"
    controllers = CGROUP_V2 / "cgroup.controllers"
    if not controllers.is_file() or "memory" not in controllers.read_text().split():
        return "needs a cgroup v2 hierarchy with the memory controller at /sys/fs/cgroup"
    return ""


def memory_hierarchy() -> Path:
    """Where memory cgroups are made: the v1 memory controller's hierarchy where it is mounted,
    else the v2 one (which of them :func:`unavailable_any` found usable)."""
    return MEMORY_V1 if not unavailable() else CGROUP_V2


def usage(memcg: Path) -> int:
    """The bytes charged to a memory cgroup of either version."""
    v1 = memcg / "memory.usage_in_bytes"
    return int((v1 if v1.exists() else memcg / "memory.current").read_text())


def cache_drops() -> int | None:
    """How many times the machine's whole page cache was dropped (``drop_pagecache`` in
    ``/proc/vmstat``; None where the kernel does not count them). On the machines the tests run
    on something outside them drops it now and then (three times in the first hour of one),
    emptying the page cache a test has just made: only a count that did not move lets that test
    judge what it measured."""
    return parse_counters(Path("/proc/vmstat").read_text()).get("drop_pagecache")


class RealRoot:
    def __init__(self, directory: Path, name: str, limit_bytes: int) -> None:
        if limit_bytes > 4 << 30:
            raise ValueError("memory experiments stay under a 4 GiB limit")
        self.v2 = bool(unavailable()) and not v2_unavailable()
        self.root = directory / "root"
        self.memcg = memory_hierarchy() / f"nriqos-{name}-{os.getpid()}"
        self.memcg.mkdir()
        self._made = [self.memcg]
        self._workers: list[subprocess.Popen[str]] = []
        self._limit = "memory.max" if self.v2 else "memory.limit_in_bytes"
        (self.memcg / self._limit).write_text(str(limit_bytes))
        cgroup = self.root / "sys/fs/cgroup"
        if self.v2:
            (self.memcg / "cgroup.subtree_control").write_text("+memory")
            cgroup.parent.mkdir(parents=True)
            cgroup.symlink_to(self.memcg)
        else:
            cgroup.mkdir(parents=True)
            (cgroup / "memory").symlink_to(self.memcg)
        (self.root / "proc").symlink_to("/proc")
        for name_ in ("devices", "kernel"):
            (self.root / "sys" / name_).symlink_to(f"/sys/{name_}")
        for rel in ("kubepods", "kubepods/burstable", "kubepods/besteffort"):
            self.mkdir(rel)

    def mkdir(self, rel: str) -> Path:
        path = self.memcg / rel
        path.mkdir()
        self._made.append(path)
        if self.v2 and (rel.count("/") < 2 or path.name.startswith("pod")):
            # the QoS and pod levels pass memory down; containers are leaves
            (path / "cgroup.subtree_control").write_text("+memory")
        return path

    def container(self, tier: str, uid: str, cid: str) -> tuple[Path, str]:
        """A pod's and its container's memcg; returns the container's memcg and the cgroups
        path NRI would report for it."""
        pod_rel = f"kubepods/{tier}/pod{uid}" if tier != "guaranteed" else f"kubepods/pod{uid}"
        self.mkdir(pod_rel)
        return self.mkdir(f"{pod_rel}/{cid}"), f"/{pod_rel}/{cid}"

    def spawn_worker(self, memcg: Path) -> Worker:
        """A pressure worker (:mod:`tests.support.pressure_worker`) in ``memcg``, pushing this
        root's limit."""
        process = subprocess.Popen(
            in_cgroup(memcg, [sys.executable, "-I", str(WORKER),
                              str(self.memcg / ("memory.events" if self.v2
                                                else "memory.failcnt"))]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._workers.append(process)
        return Worker(process)

    def close(self) -> None:
        end(self._workers, self._made)

    def __enter__(self) -> RealRoot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def end(processes: list[subprocess.Popen[Any]], cgroups: list[Path]) -> None:
    """Kills ``processes``, then removes ``cgroups`` (deepest, i.e. last made, first)."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
    for path in reversed(cgroups):
        remove_cgroup(path, within_s=2.0)


class Worker:
    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._process = process

    def kill(self) -> None:
        """Ends the worker: a command it is running answers with RuntimeError."""
        self._process.kill()

    def ask(self, command: str) -> dict[str, Any]:
        assert self._process.stdin is not None
        assert self._process.stdout is not None
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the pressure worker ended (status {self._process.poll()})")
        answer: dict[str, Any] = json.loads(line)
        return answer


def data_file(path: Path, mib: int) -> Path:
    """A file of ``mib`` MiB on disk, written by this process and dropped from the page cache,
    so that whoever reads it next is charged for it."""
    if not path.exists() or path.stat().st_size != mib * MIB:
        block = b"\xa5" * MIB
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path
