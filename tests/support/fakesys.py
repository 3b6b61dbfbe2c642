"""Builders of fake /sys and /proc trees under a directory, shaped like the kernel's.

A :class:`FakeHost` is a root directory holding ``sys/fs/cgroup`` (cgroup v1 with the cgroupfs
driver, or v2 with the systemd driver, or any other combination), ``proc/<pid>/cgroup`` and
``proc/<pid>/oom_score_adj`` for every task, NUMA node meminfo and ``/proc/zoneinfo``, and
optionally a resctrl tree. Pods added with :meth:`FakeHost.add_pod` come back as the
:class:`~hooks.model.PodInfo` / :class:`~hooks.model.ContainerInfo` that NRI would report, so
tests feed the same objects to :class:`~common.state.NodeState`.

Regular files stand in for kernel files: writes replace the content (``tasks`` files are
appended to, as the reconciler opens them for appending), so a test reads back what was written.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hooks.model import ContainerInfo, PodInfo
from protos import nri_api_pb2 as api

GIB = 1 << 30
MIB = 1 << 20
UNLIMITED_V1 = "9223372036854771712"
PAGE = 4096
ONE_ZONE = "Node 0, zone Normal\n  pages free 256\n        min 8\n        low 10\n        high 12\n"
"""A ``/proc/zoneinfo`` of one zone whose low watermark is 10 pages."""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


READ_ONLY_NUMBER = Path("/proc/sys/kernel/ngroups_max")
"""A kernel file that reads as a number and refuses every write: EACCES even for root (a
read-only sysctl), EROFS where ``/proc/sys`` is mounted read-only."""


def refuse_writes(path: Path) -> None:
    """Put in place of ``path`` a file that still reads as a number but whose writes fail, as
    a cgroup file the kernel refuses to change (a directory would fail the read first)."""
    path.unlink(missing_ok=True)
    path.symlink_to(READ_ONLY_NUMBER)


@dataclass
class FakeContainer:
    info: ContainerInfo
    rel: str
    pids: list[int]
    tids: list[int]


@dataclass
class FakePod:
    info: PodInfo
    tier: str
    containers: list[FakeContainer] = field(default_factory=list)


class FakeHost:
    """A fake host root; see the module doc."""

    def __init__(self, root: Path, *, version: int = 1, driver: str = "cgroupfs",
                 first_pid: int = 1000) -> None:
        self.root = root
        self.version = version
        self.driver = driver
        self._pids = itertools.count(first_pid)
        self.pods: list[FakePod] = []
        self.cgroup = root / "sys/fs/cgroup"
        if version == 2:
            write(self.cgroup / "cgroup.controllers", "cpuset cpu io memory pids\n")
            # A kernel with PSI on has pressure files in every cgroup, the root's included.
            write(self.cgroup / "memory.pressure",
                  "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                  "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
        for tier in ("guaranteed", "burstable", "besteffort"):
            self._make_dir(self.tier_rel(tier))
        if version == 1:
            # Every v1 cgroup has it; a registration written to the plain file is taken.
            write(self.cg("memory", "") / "cgroup.event_control", "")
        (root / "proc").mkdir(parents=True, exist_ok=True)

    # -- layout ----------------------------------------------------------------------------------

    def controllers(self) -> Sequence[str]:
        return ("",) if self.version == 2 else ("cpu", "memory", "cpuset")

    def cg(self, controller: str, rel: str) -> Path:
        """Real path of a cgroup directory."""
        base = self.cgroup if self.version == 2 else self.cgroup / controller
        return base / rel if rel else base

    def tier_rel(self, tier: str) -> str:
        if self.driver == "systemd":
            return "kubepods.slice" if tier == "guaranteed" \
                else f"kubepods.slice/kubepods-{tier}.slice"
        return "kubepods" if tier == "guaranteed" else f"kubepods/{tier}"

    def pod_rel(self, tier: str, uid: str) -> str:
        if self.driver == "systemd":
            name = "kubepods" if tier == "guaranteed" else f"kubepods-{tier}"
            return f"{self.tier_rel(tier)}/{name}-pod{uid.replace('-', '_')}.slice"
        return f"{self.tier_rel(tier)}/pod{uid}"

    def _nri_paths(self, tier: str, uid: str, cid: str) -> tuple[str, str]:
        """(pod cgroup parent, container cgroups_path) as NRI reports them."""
        if self.driver == "systemd":
            name = "kubepods" if tier == "guaranteed" else f"kubepods-{tier}"
            parent = f"{name}-pod{uid.replace('-', '_')}.slice"
            return parent, f"{parent}:cri-containerd:{cid}"
        parent = "/" + self.pod_rel(tier, uid)
        return parent, f"{parent}/{cid}"

    def container_rel(self, tier: str, uid: str, cid: str) -> str:
        leaf = f"cri-containerd-{cid}.scope" if self.driver == "systemd" else cid
        return f"{self.pod_rel(tier, uid)}/{leaf}"

    def _make_dir(self, rel: str, *, memory_usage: int = 0) -> None:
        v2 = self.version == 2
        for controller in self.controllers():
            d = self.cg(controller, rel)
            d.mkdir(parents=True, exist_ok=True)
            if v2:
                files = {"cgroup.procs": "", "cgroup.threads": "", "memory.max": "max\n",
                         "memory.high": "max\n", "memory.low": "0\n", "memory.min": "0\n",
                         "memory.current": f"{memory_usage}\n", "cpuset.mems": "\n"}
            elif controller == "memory":
                files = {"cgroup.procs": "", "tasks": "",
                         "memory.limit_in_bytes": UNLIMITED_V1 + "\n",
                         "memory.soft_limit_in_bytes": UNLIMITED_V1 + "\n",
                         "memory.usage_in_bytes": f"{memory_usage}\n",
                         "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n"}
            elif controller == "cpuset":
                files = {"cgroup.procs": "", "tasks": "", "cpuset.mems": "\n",
                         "cpuset.memory_migrate": "0\n"}
            else:
                files = {"cgroup.procs": "", "tasks": ""}
            for name, text in files.items():
                if not (d / name).exists():
                    (d / name).write_text(text)

    # -- pods ------------------------------------------------------------------------------------

    def add_pod(self, uid: str, *, tier: str = "burstable", name: str | None = None,
                namespace: str = "default", annotations: dict[str, str] | None = None,
                labels: dict[str, str] | None = None, containers: int = 1,
                threads: int = 2, memory_limit: int | None = None,
                memory_request: int | None = None) -> FakePod:
        """A pod with ``containers`` containers of one process with ``threads`` threads each."""
        parent, _ = self._nri_paths(tier, uid, "x")
        info = PodInfo(id=f"sandbox-{uid}", uid=uid, name=name or f"pod-{uid[:8]}",
                       namespace=namespace, labels=dict(labels or {}),
                       annotations=dict(annotations or {}), cgroup_parent=parent)
        pod = FakePod(info, tier)
        self._make_dir(self.pod_rel(tier, uid))
        for index in range(containers):
            cid = f"{uid.replace('-', '')}{index:04d}".ljust(64, "0")[:64]
            pod.containers.append(self.add_container(pod, cid, f"c{index}", threads=threads,
                                                     memory_limit=memory_limit,
                                                     memory_request=memory_request))
        self.pods.append(pod)
        return pod

    def remove_pod(self, pod: FakePod) -> None:
        """The runtime removed the pod: its cgroups (every controller) and its processes go."""
        for container in pod.containers:
            for tid in container.tids:
                shutil.rmtree(self.root / "proc" / str(tid), ignore_errors=True)
        for controller in self.controllers():
            shutil.rmtree(self.cg(controller, self.pod_rel(pod.tier, pod.info.uid)))
        self.pods.remove(pod)

    def add_container(self, pod: FakePod, cid: str, name: str, *, threads: int = 2,
                      memory_limit: int | None = None,
                      memory_request: int | None = None) -> FakeContainer:
        _, cgroups_path = self._nri_paths(pod.tier, pod.info.uid, cid)
        rel = self.container_rel(pod.tier, pod.info.uid, cid)
        self._make_dir(rel)
        pid = next(self._pids)
        info = ContainerInfo(id=cid, pod_sandbox_id=pod.info.id, name=name,
                             cgroups_path=cgroups_path, pid=pid, memory_limit=memory_limit,
                             memory_request=memory_request)
        container = FakeContainer(info, rel, [], [])
        self.add_process(container, pid=pid, threads=threads)
        return container

    def add_process(self, container: FakeContainer, *, pid: int | None = None,
                    threads: int = 1, oom_score_adj: int = 0) -> list[int]:
        """A process (and its extra threads) in the container; returns its task ids."""
        pid = pid if pid is not None else next(self._pids)
        tids = [pid] + [next(self._pids) for _ in range(threads - 1)]
        container.pids.append(pid)
        container.tids.extend(tids)
        for controller in self.controllers():
            d = self.cg(controller, container.rel)
            _append(d / "cgroup.procs", [pid])
            _append(d / ("cgroup.threads" if self.version == 2 else "tasks"), tids)
        for tid in tids:
            proc = self.root / "proc" / str(tid)
            proc.mkdir(parents=True, exist_ok=True)
            (proc / "cgroup").write_text(self.proc_cgroup(container.rel))
            (proc / "oom_score_adj").write_text(f"{oom_score_adj}\n")
        return tids

    def proc_cgroup(self, rel: str) -> str:
        if self.version == 2:
            return f"0::/{rel}\n"
        return (f"12:memory:/{rel}\n11:cpuset:/{rel}\n4:cpu,cpuacct:/{rel}\n"
                f"1:name=systemd:/{rel}\n")

    def add_system_task(self, tid: int) -> None:
        """A task outside every pod (a system daemon or kernel thread)."""
        proc = self.root / "proc" / str(tid)
        proc.mkdir(parents=True, exist_ok=True)
        (proc / "cgroup").write_text("0::/system.slice/daemon.service\n" if self.version == 2
                                     else "4:cpu,cpuacct:/system.slice/daemon.service\n")
        (proc / "oom_score_adj").write_text("0\n")

    def nri(self) -> tuple[list[PodInfo], list[ContainerInfo]]:
        """What a Synchronize would report."""
        return ([p.info for p in self.pods],
                [c.info for p in self.pods for c in p.containers])

    def all_tids(self) -> list[int]:
        return [t for p in self.pods for c in p.containers for t in c.tids]

    # -- memory files ----------------------------------------------------------------------------

    def tier_dir(self, tier: str, controller: str = "memory") -> Path:
        return self.cg(controller, self.tier_rel(tier))

    def set_tier_usage(self, tier: str, usage: int, per_node: Sequence[int] | None = None) -> None:
        d = self.tier_dir(tier)
        (d / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")).write_text(
            f"{usage}\n")
        if per_node is None:
            return
        nodes = " ".join(f"N{i}={v}" for i, v in enumerate(per_node))
        if self.version == 2:
            anon = " ".join(f"N{i}={v // 2}" for i, v in enumerate(per_node))
            file = " ".join(f"N{i}={v - v // 2}" for i, v in enumerate(per_node))
            zero = " ".join(f"N{i}=0" for i in range(len(per_node)))
            text = f"anon {anon}\nfile {file}\nkernel_stack {zero}\nshmem {zero}\n"
        else:
            pages = " ".join(f"N{i}={v // PAGE}" for i, v in enumerate(per_node))
            text = (f"total={sum(per_node) // PAGE} {pages}\nfile=0 {nodes}\n"
                    f"hierarchical_total={sum(per_node) // PAGE} {pages}\n")
        (d / "memory.numa_stat").write_text(text)

    def set_pod_anon(self, pod: FakePod, anon: int, *, cache: int = 0) -> Path:
        """The pod cgroup's ``memory.stat``: ``anon`` bytes of anonymous memory (and page cache),
        shaped like the kernel's file of the host's cgroup version."""
        d = self.cg("memory", self.pod_rel(pod.tier, pod.info.uid))
        if self.version == 2:
            text = f"anon {anon}\nfile {cache}\nkernel 0\nshmem 0\n"
        else:
            text = (f"cache 0\nrss 0\nrss_huge 0\nshmem 0\n"
                    f"total_cache {cache}\ntotal_rss {anon}\ntotal_rss_huge 0\n")
        return write(d / "memory.stat", text)

    def set_container_numa(self, container: FakeContainer, per_node: Sequence[int]) -> None:
        """The container's ``memory.numa_stat`` (its bytes per NUMA node, as anonymous memory)
        and a ``cpuset.mems`` allowing every one of those nodes."""
        memory, cpuset = self.cg("memory", container.rel), self.cg("cpuset", container.rel)
        if self.version == 2:
            anon = " ".join(f"N{i}={v}" for i, v in enumerate(per_node))
            zero = " ".join(f"N{i}=0" for i in range(len(per_node)))
            text = f"anon {anon}\nfile {zero}\n"
        else:
            pages = " ".join(f"N{i}={v // PAGE}" for i, v in enumerate(per_node))
            text = f"total={sum(per_node) // PAGE} {pages}\nanon={sum(per_node) // PAGE} {pages}\n"
        write(memory / "memory.numa_stat", text)
        write(cpuset / "cpuset.mems", f"0-{len(per_node) - 1}\n")

    # -- NUMA ------------------------------------------------------------------------------------

    def set_numa(self, nodes: Sequence[tuple[int, int, int]],
                 memory_only: Sequence[int] = ()) -> None:
        """``(free_bytes, total_bytes, low_watermark_pages)`` per node; writes node meminfo,
        /proc/zoneinfo (node 0 gets a DMA32 zone too, as on x86), /proc/meminfo, and the nodes
        with CPUs and with memory (``has_cpu``: all but ``memory_only``; ``has_memory``: those
        with a total)."""
        base = self.root / "sys/devices/system/node"
        zoneinfo = []
        for i, (free, total, low) in enumerate(nodes):
            write(base / f"node{i}" / "meminfo",
                  f"Node {i} MemTotal:       {total // 1024} kB\n"
                  f"Node {i} MemFree:        {free // 1024} kB\n"
                  f"Node {i} MemUsed:        {(total - free) // 1024} kB\n"
                  f"Node {i} HugePages_Total:     0\n")
            zones = [("DMA32", low // 4), ("Normal", low - low // 4)] if i == 0 \
                else [("Normal", low)]
            for zi, (zone, zlow) in enumerate(zones):
                zoneinfo.append(f"Node {i}, zone {zone:>8}\n")
                if zi == 0:
                    zoneinfo.append("  per-node stats\n      nr_inactive_anon 100\n")
                zoneinfo.append(f"  pages free     {free // PAGE // len(zones)}\n"
                                f"        boost    0\n        min      {zlow * 4 // 5}\n"
                                f"        low      {zlow}\n        high     {zlow * 6 // 5}\n"
                                f"        spanned  1000\n        present  1000\n"
                                f"        protection: (0, 0, 0, 0)\n      nr_free_pages 1\n")
        write(base / "online", f"0-{len(nodes) - 1}\n")
        write(base / "has_cpu", ",".join(str(i) for i in range(len(nodes))
                                         if i not in memory_only) + "\n")
        write(base / "has_memory", ",".join(str(i) for i, n in enumerate(nodes) if n[1]) + "\n")
        write(self.root / "proc/zoneinfo", "".join(zoneinfo))
        total_free = sum(n[0] for n in nodes)
        total = sum(n[1] for n in nodes)
        write(self.root / "proc/meminfo",
              f"MemTotal:       {total // 1024} kB\nMemFree:        {total_free // 1024} kB\n")

    # -- resctrl ---------------------------------------------------------------------------------

    def make_resctrl(self, *, monitoring: bool = True) -> Path:
        """An Intel-like resctrl mount: 11-bit CBM, 16 CLOS, MB in 10 % steps, two cache ids."""
        r = self.root / "sys/fs/resctrl"
        write(r / "info/L3/cbm_mask", "7ff\n")
        write(r / "info/L3/min_cbm_bits", "1\n")
        write(r / "info/L3/num_closids", "16\n")
        write(r / "info/MB/bandwidth_gran", "10\n")
        write(r / "info/MB/min_bandwidth", "10\n")
        write(r / "info/MB/num_closids", "8\n")
        write(r / "info/MB/delay_linear", "1\n")
        if monitoring:
            (r / "info/L3_MON").mkdir(parents=True, exist_ok=True)
        write(r / "schemata", "L3:0=7ff;1=7ff\nMB:0=100;1=100\n")
        write(r / "tasks", "")
        return r

    def add_resctrl_group(self, name: str, *, monitor: bool = False) -> Path:
        r = self.root / "sys/fs/resctrl" / name
        write(r / "schemata", "L3:0=7ff;1=7ff\nMB:0=100;1=100\n")
        write(r / "tasks", "")
        if monitor:
            write(r / "mon_groups" / name / "tasks", "")
        return r


def _append(path: Path, ids: Sequence[int]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(f"{i}\n" for i in ids).encode())
    finally:
        os.close(fd)


def read_ids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def nri_messages(pod: FakePod, *, state: api.ContainerState = api.CONTAINER_RUNNING,
                 memory_limit: int | None = None) -> tuple[api.PodSandbox, list[api.Container]]:
    """The pod and its containers as the runtime describes them over NRI."""
    info = pod.info
    sandbox = api.PodSandbox(id=info.id, uid=info.uid, name=info.name, namespace=info.namespace,
                             annotations=dict(info.annotations))
    sandbox.linux.cgroup_parent = info.cgroup_parent
    containers = []
    for c in pod.containers:
        container = api.Container(id=c.info.id, pod_sandbox_id=info.id, name=c.info.name,
                                  state=state, pid=c.info.pid)
        container.linux.cgroups_path = c.info.cgroups_path
        if memory_limit is not None:
            container.linux.resources.memory.limit.value = memory_limit
        containers.append(container)
    return sandbox, containers
