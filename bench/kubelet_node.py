"""A node carved out of this machine's real cgroup hierarchy, laid out as kubelet lays it out.

The node is one child cgroup of the machine's memory hierarchy with a memory limit of at most
4 GiB, so that whatever runs in it can never put the machine at risk. Below it is kubelet's
cgroupfs layout: ``kubepods`` (limited to node allocatable: the node's memory less what is
reserved for the system, as kubelet's ``enforce-node-allocatable=pods`` does),
``kubepods/burstable``, ``kubepods/besteffort``, and a cgroup per pod and container
(:meth:`KubeletNode.add_pod`), with kubelet's memory limits and CPU shares. On cgroup v2 the
node carries ``kubepods``' ``memory.min`` and ``memory.low`` (:meth:`KubeletNode.pass_protection`):
it stands for a machine's root cgroup, which bounds no protection below it.

* **cgroup v2** where the unified hierarchy at ``/sys/fs/cgroup`` has the memory controller:
  ``memory.max``, ``cpu.weight``, and each cgroup's own ``memory.pressure``/``io.pressure``.
* **cgroup v1** otherwise (``/sys/fs/cgroup/memory``): ``memory.limit_in_bytes``, ``cpu.shares``
  in the v1 cpu hierarchy when there is one, and per-cgroup PSI from a mirror of the subtree in
  the cgroup2 hierarchy mounted beside v1 (``/sys/fs/cgroup/unified``) when there is one: the
  kernel accounts pressure per cgroup2 group whatever the memory controller's version.

:meth:`KubeletNode.agent_root` makes a directory that nri-qos can use as ``reconciler.root``:
its ``/proc`` and ``/sys/devices`` are the machine's, its cgroup mount is the node, so the
agent's own code finds kubelet's layout there, and whatever it writes stays inside.

Processes are started inside a container's cgroups (:meth:`KubeletNode.spawn`) before they
run any code, because charges do not move with a task. :meth:`KubeletNode.close` kills them and
removes every cgroup made, deepest first; :func:`sweep` removes what a run that was killed
outright left behind. Needs root (:func:`unavailable` says why not).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from reconciler.host.parse import parse_counters, parse_psi

CGROUP = Path("/sys/fs/cgroup")
MEMORY_V1 = CGROUP / "memory"
CPU_V1 = CGROUP / "cpu"
UNIFIED_V1 = CGROUP / "unified"
MIB = 1 << 20
GIB = 1 << 30
MAX_NODE_BYTES = 4 * GIB
"""No node may be larger: the machine's own memory is never at risk."""
PREFIX = "nriqos-"
PROTECTION = ("memory.min", "memory.low")
_JOIN = ('n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; '
         'n=$((n - 1)); done; [ "$1" = - ] || echo "$1" > /proc/self/oom_score_adj || exit 125; '
         'shift; exec "$@"')
"""Put the shell into each cgroup, set its oom_score_adj ("-": keep it), then become the
workload."""


def v2_memory() -> bool:
    """Whether the unified hierarchy at /sys/fs/cgroup has the memory controller."""
    try:
        return "memory" in (CGROUP / "cgroup.controllers").read_text().split()
    except OSError:
        return False


def enable_at_root(enable: str) -> None:
    """cgroup v2: the root passes ``enable`` (``+memory +cpu``) to its children, as systemd sets
    it up at boot on every node. A root set up by anything else may enable nothing, and then no
    cgroup below it has a memory controller. Left enabled: other cgroups may come to rely on it."""
    wanted = enable.split()
    have = (CGROUP / "cgroup.subtree_control").read_text().split()
    if any(c.lstrip("+") not in have for c in wanted):
        (CGROUP / "cgroup.subtree_control").write_text(enable)


def unavailable() -> str:
    """Why no node can be made here ("" when one can)."""
    if os.geteuid() != 0:
        return "needs root"
    if not v2_memory() and not (MEMORY_V1 / "memory.limit_in_bytes").is_file():
        return "needs a memory controller (cgroup v2 with memory, or cgroup v1 memory)"
    return ""


def shares_to_weight(shares: int) -> int:
    """kubelet's conversion of cgroup v1 cpu.shares to cgroup v2 cpu.weight."""
    return 1 + ((shares - 2) * 9999) // 262142


def kubelet_oom_score_adj(request_bytes: int, capacity_bytes: int, qos: str) -> int:
    """The oom_score_adj kubelet gives a container (its pod's QoS class, its memory request)."""
    if qos == "guaranteed":
        return -997
    if qos == "besteffort":
        return 1000
    return min(max(2, 1000 - 1000 * request_bytes // capacity_bytes), 999)


@dataclass(frozen=True, slots=True)
class Container:
    """A container's cgroup, relative to the node, and the cgroups path NRI reports."""

    rel: str
    cgroups_path: str
    pod_rel: str


class KubeletNode:
    def __init__(self, name: str, memory_bytes: int, reserved_bytes: int, cpus: int) -> None:
        if memory_bytes > MAX_NODE_BYTES:
            raise ValueError(f"a node is at most {MAX_NODE_BYTES >> 20} MiB")
        if not 0 <= reserved_bytes < memory_bytes:
            raise ValueError("the reserved memory must be below the node's")
        self.v2 = v2_memory()
        self.name = f"{PREFIX}{name}-{os.getpid()}"
        self.memory_bytes = memory_bytes
        self.allocatable_bytes = memory_bytes - reserved_bytes
        self.cpus = cpus
        self.memory = (CGROUP if self.v2 else MEMORY_V1) / self.name
        # Where CPU shares are set and where pressure is read: the same cgroups on v2.
        if self.v2:
            controllers = (CGROUP / "cgroup.controllers").read_text().split()
            self.cpu: Path | None = self.memory if "cpu" in controllers else None
            self._enable = " ".join(f"+{c}" for c in ("memory", "cpu") if c in controllers)
            enable_at_root(self._enable)
        else:
            self.cpu = CPU_V1 / self.name if (CPU_V1 / "cpu.shares").is_file() else None
            self._enable = ""
        self.psi = self.memory if self.v2 else (
            UNIFIED_V1 / self.name if (UNIFIED_V1 / "memory.pressure").is_file() else None)
        self._made: list[Path] = []
        self._processes: list[subprocess.Popen[str]] = []
        self._burstable_shares = 0
        try:
            self._mkdir("", inner=True)
            self._write(self.memory, self._limit_file, str(memory_bytes))
            for rel in ("kubepods", "kubepods/burstable", "kubepods/besteffort"):
                self._mkdir(rel, inner=True)
            self._write(self.memory / "kubepods", self._limit_file, str(self.allocatable_bytes))
            self._shares("kubepods", cpus * 1024)
            self._shares("kubepods/besteffort", 2)
            self._shares("kubepods/burstable", 2)
        except BaseException:
            self.close()
            raise

    @property
    def version(self) -> str:
        return "v2" if self.v2 else "v1"

    @property
    def _limit_file(self) -> str:
        return "memory.max" if self.v2 else "memory.limit_in_bytes"

    def describe(self) -> str:
        cpu = "cpu.weight" if self.v2 else ("cpu.shares" if self.cpu else "no cpu controller")
        psi = ("per-cgroup PSI" if self.v2 else
               f"per-cgroup PSI from {UNIFIED_V1}" if self.psi else "no per-cgroup PSI")
        return (f"cgroup {self.version} memory controller at {self.memory.parent}; {cpu}; "
                f"{psi}")

    # -- making cgroups ------------------------------------------------------------------------

    def _roots(self) -> list[Path]:
        return list(dict.fromkeys(r for r in (self.memory, self.cpu, self.psi) if r is not None))

    def _mkdir(self, rel: str, *, inner: bool) -> None:
        """``rel`` in every hierarchy; an inner cgroup passes its controllers on (v2)."""
        for root in self._roots():
            path = root / rel if rel else root
            path.mkdir()
            self._made.append(path)
            if inner and self._enable:
                self._write(path, "cgroup.subtree_control", self._enable)

    @staticmethod
    def _write(directory: Path, name: str, value: str) -> None:
        (directory / name).write_text(value)

    def _shares(self, rel: str, shares: int) -> None:
        if self.cpu is None:
            return
        if self.v2:
            self._write(self.cpu / rel, "cpu.weight", str(shares_to_weight(shares)))
        else:
            self._write(self.cpu / rel, "cpu.shares", str(shares))

    def add_pod(self, tier: str, uid: str, container_id: str, *, memory_limit: int | None,
                cpu_request_milli: int) -> Container:
        """A pod with one container in ``tier`` (burstable or besteffort), with kubelet's
        memory limit (the container's, also the pod's) and CPU shares (from the request)."""
        if tier not in ("burstable", "besteffort"):
            raise ValueError(f"no such tier here: {tier!r}")
        pod_rel = f"kubepods/{tier}/pod{uid}"
        rel = f"{pod_rel}/{container_id}"
        self._mkdir(pod_rel, inner=True)
        self._mkdir(rel, inner=False)
        shares = 2 if tier == "besteffort" else max(2, cpu_request_milli * 1024 // 1000)
        for cgroup in (pod_rel, rel):
            if memory_limit is not None:
                self.set_limit(cgroup, memory_limit)
            self._shares(cgroup, shares)
        if tier == "burstable":
            self._burstable_shares += shares
            self._shares("kubepods/burstable", self._burstable_shares)
        return Container(rel, f"/{rel}", pod_rel)

    def set_limit(self, rel: str, limit: int) -> None:
        self._write(self.memory / rel, self._limit_file, str(limit))

    def pass_protection(self) -> None:
        """cgroup v2: give the node ``kubepods``' ``memory.min`` and ``memory.low``, as they are
        now (called again whenever they may have changed).

        The node stands for a machine's root cgroup, which bounds no one's protection. A child
        cgroup of the root does: the kernel bounds each cgroup's effective protection by its
        parent's, so under the machine's own reclaim (kswapd, direct reclaim) a node left at 0
        would void every ``memory.min`` and ``memory.low`` below it, kubelet's MemoryQoS's and
        the agent's alike. Carrying exactly ``kubepods``' values passes its protection through
        unchanged (with ``memory_recursiveprot`` too: nothing is left over to hand down)."""
        if not self.v2:
            return
        for key in PROTECTION:
            wanted = (self.memory / "kubepods" / key).read_text()
            if (self.memory / key).read_text() != wanted:
                self._write(self.memory, key, wanted)

    def agent_root(self, directory: Path) -> Path:
        """A host root for the agent (``reconciler.root``) whose cgroups are this node's."""
        root = directory / "root"
        cgroup = root / "sys/fs/cgroup"
        if self.v2:
            cgroup.parent.mkdir(parents=True)
            cgroup.symlink_to(self.memory)
        else:
            cgroup.mkdir(parents=True)
            (cgroup / "memory").symlink_to(self.memory)
            if self.cpu is not None:
                (cgroup / "cpu").symlink_to(self.cpu)
        (root / "proc").symlink_to("/proc")
        for name in ("devices", "kernel"):
            (root / "sys" / name).symlink_to(f"/sys/{name}")
        return root

    # -- processes -----------------------------------------------------------------------------

    def inside(self, rel: str, argv: list[str], oom_score_adj: int | None) -> list[str]:
        """``argv`` wrapped so that it starts inside ``rel`` (every hierarchy) with
        ``oom_score_adj`` (None: inherited), before it runs any code of its own."""
        procs = [str(root / rel / "cgroup.procs") for root in self._roots()]
        adj = "-" if oom_score_adj is None else str(oom_score_adj)
        return ["/bin/sh", "-c", _JOIN, "sh", str(len(procs)), *procs, adj, *argv]

    def spawn(self, rel: str, argv: list[str], *, oom_score_adj: int,
              stdout: int | IO[str] | None = subprocess.PIPE) -> subprocess.Popen[str]:
        """Start ``argv`` inside ``rel`` (:meth:`inside`); killed by :meth:`close`."""
        process = subprocess.Popen(self.inside(rel, argv, oom_score_adj),
                                   stdin=subprocess.PIPE, stdout=stdout, text=True)
        self._processes.append(process)
        return process

    def stop(self, process: subprocess.Popen[str], timeout_s: float = 10.0) -> None:
        """Ask a workload to stop (``stop`` on stdin), kill it if it does not."""
        try:
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.write("stop\n")
                process.stdin.close()
        except OSError:  # it is gone already
            pass
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    # -- reading -------------------------------------------------------------------------------

    def stat(self, rel: str) -> dict[str, int]:
        """``memory.stat`` of ``rel`` as numbers."""
        return self.keyed(rel, "memory.stat")

    def keyed(self, rel: str, name: str) -> dict[str, int]:
        """A flat-keyed memory file of ``rel`` (``key value`` lines) as numbers."""
        return parse_counters((self.memory / rel / name).read_text())

    def usage(self, rel: str) -> int:
        name = "memory.current" if self.v2 else "memory.usage_in_bytes"
        return int((self.memory / rel / name).read_text())

    def peak(self, rel: str) -> int | None:
        """The most memory ``rel`` has held since it was made: v2 ``memory.peak`` (5.19 on),
        v1 ``memory.max_usage_in_bytes``; None on a kernel without it."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.memory / rel / name).read_text())
        except (OSError, ValueError):
            return None

    def limit_hits(self, rel: str) -> int:
        """How often a charge hit ``rel``'s limit: v1 ``memory.failcnt``, v2 the ``max`` count
        of ``memory.events``."""
        if not self.v2:
            return int((self.memory / rel / "memory.failcnt").read_text())
        return self.keyed(rel, "memory.events").get("max", 0)

    def throttle_hits(self, rel: str) -> int | None:
        """How often ``rel``'s usage went over its ``memory.high`` and it was reclaimed and
        throttled for it: v2's ``high`` count of ``memory.events``; None on v1, which has no
        such bound."""
        return self.keyed(rel, "memory.events").get("high", 0) if self.v2 else None

    def stall_us(self, rel: str, resource: str) -> int | None:
        """Cumulative 'some' stall (µs) of ``rel`` on ``resource`` (memory, io); None without
        per-cgroup PSI."""
        if self.psi is None:
            return None
        try:
            text = (self.psi / rel / f"{resource}.pressure").read_text()
        except OSError:
            return None
        return parse_psi(text).some_total_us

    # -- cleaning up ---------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process started here and remove every cgroup made; idempotent."""
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()
        self._processes.clear()
        for path in reversed(self._made):
            remove_cgroup(path)
        self._made.clear()


def remove_cgroup(path: Path, within_s: float = 2.0) -> bool:
    """Removes the cgroup ``path``, trying for up to ``within_s`` seconds, because a cgroup its
    tasks have just left stays busy for a moment; True once it is gone (or never was)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def sweep(name: str) -> list[Path]:
    """Remove the cgroups of nodes called ``name`` whose process is gone (a run killed
    outright), deepest first, after killing whatever still runs in them; the cgroups removed."""
    ours = re.compile(rf"{PREFIX}{re.escape(name)}-(\d+)")
    removed: list[Path] = []
    for parent in (CGROUP, MEMORY_V1, CPU_V1, UNIFIED_V1):
        if not parent.is_dir():
            continue
        for top in parent.iterdir():
            match = ours.fullmatch(top.name)
            if match is None or not top.is_dir() or _alive(int(match.group(1))):
                continue
            for directory in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if not directory.is_dir():
                    continue
                _kill_tasks(directory)
                if remove_cgroup(directory):
                    removed.append(directory)
            _kill_tasks(top)
            if remove_cgroup(top):
                removed.append(top)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_tasks(directory: Path) -> None:
    try:
        pids = [int(p) for p in (directory / "cgroup.procs").read_text().split()]
    except OSError:
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
