"""The node inside a guest: kubelet's cgroup v2 layout on the guest's real cgroup2 root.

For the tests of ``tests/real``, which run only in guests (see :mod:`tests.vm.tier`), and
``bench/numa_balance.py`` there: the guest is the node, so its memory is the node's, its kswapd
and global reclaim are the node's, and the agent reads the real ``/proc`` and ``/sys`` through
``SysFs("/")``. :class:`Node` makes ``/sys/fs/cgroup/kubepods{,/burstable,/besteffort}`` with the
controllers kubelet enables, pods and containers below them, and processes in them; it removes
everything it made.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo
from tests.support.realroot import WORKER, Worker, end, in_cgroup

CGROUP = Path("/sys/fs/cgroup")
MIB = 1 << 20
CONTROLLERS = "+cpuset +cpu +io +memory +pids"


def free(node: int) -> int:
    """The NUMA node's free memory in bytes, as its ``meminfo`` says."""
    for line in Path(f"/sys/devices/system/node/node{node}/meminfo").read_text().splitlines():
        words = line.split()
        if words[2] == "MemFree:":
            return int(words[3]) * 1024
    raise KeyError(node)


class Node:
    def __init__(self) -> None:
        if not (CGROUP / "cgroup.controllers").is_file():
            raise RuntimeError("not a cgroup v2 guest")
        self._made: list[Path] = []
        self._processes: list[subprocess.Popen[Any]] = []
        for rel in ("kubepods", "kubepods/burstable", "kubepods/besteffort"):
            self.mkdir(rel)

    def mkdir(self, rel: str) -> Path:
        path = CGROUP / rel
        path.mkdir()
        self._made.append(path)
        # As kubelet does: the QoS and pod levels pass every controller down (a container's
        # cgroup is a leaf: one with controllers enabled below it could not hold processes).
        if rel.count("/") < 2 or path.name.startswith("pod"):
            (path / "cgroup.subtree_control").write_text(CONTROLLERS)
        return path

    def pod(self, tier: str, uid: str) -> Path:
        return self.mkdir(f"kubepods/{tier}/pod{uid}" if tier != "guaranteed"
                          else f"kubepods/pod{uid}")

    def container(self, tier: str, uid: str, cid: str) -> tuple[Path, str]:
        """A pod's container cgroup (the pod's made too if needed) and the cgroups path NRI
        reports for it."""
        pod_rel = f"kubepods/{tier}/pod{uid}" if tier != "guaranteed" else f"kubepods/pod{uid}"
        if not (CGROUP / pod_rel).is_dir():
            self.mkdir(pod_rel)
        return self.mkdir(f"{pod_rel}/{cid}"), f"/{pod_rel}/{cid}"

    def spawn(self, cgroup: Path, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``argv`` started inside ``cgroup`` (the shell moves itself before it execs)."""
        process = subprocess.Popen(in_cgroup(cgroup, argv), **kwargs)
        self._processes.append(process)
        return process

    def worker(self, cgroup: Path, pushed: Path) -> Worker:
        """A pressure worker (:mod:`tests.support.pressure_worker`) in ``cgroup`` that pushes the
        limit of ``pushed`` (its ``memory.events`` counts the hits)."""
        return Worker(self.spawn(cgroup, [sys.executable, "-I", str(WORKER),
                                          str(pushed / "memory.events")],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))

    def holder(self, cgroup: Path, mib: int) -> subprocess.Popen[str]:
        """A process in ``cgroup`` holding ``mib`` MiB of anonymous memory, touched; it prints
        ``ready`` once it holds it."""
        process = self.spawn(cgroup, [sys.executable, "-I", "-c", HOLD, str(mib)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"
        return process

    def kill_processes(self) -> None:
        """Every process started in the node's cgroups ends (their cgroups can then go)."""
        end(self._processes, [])

    def close(self) -> None:
        end(self._processes, self._made)


HOLD = (
    "import sys\n"
    "b = bytearray(int(sys.argv[1]) << 20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


def read_int(path: Path) -> int:
    return int(path.read_text())


def memory_stat(cgroup: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in
                                   (cgroup / "memory.stat").read_text().splitlines())}


def numa_stat(cgroup: Path, key: str) -> dict[int, int]:
    """One line of ``memory.numa_stat`` as bytes per node."""
    for line in (cgroup / "memory.numa_stat").read_text().splitlines():
        name, *fields = line.split()
        if name == key:
            return {int(f.split("=")[0][1:]): int(f.split("=")[1]) for f in fields}
    raise KeyError(key)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def pod_infos(uid: str, level: str, cid: str, cgroups_path: str, request: int | None = None
              ) -> tuple[list[PodInfo], list[ContainerInfo]]:
    """One pod at QoS ``level`` with one container at ``cgroups_path`` (as :meth:`Node.container`
    gives it), as the runtime reports them (``request``: the container's memory request in
    bytes)."""
    return ([PodInfo(id="sandbox", uid=uid, name="pod", namespace="test",
                     cgroup_parent=cgroups_path.rsplit("/", 1)[0],
                     annotations={"qos.nri-qos.io/level": level})],
            [ContainerInfo(id=cid, pod_sandbox_id="sandbox", name="c", cgroups_path=cgroups_path,
                           memory_request=request)])


def one_pod(uid: str, level: str, cid: str, cgroups_path: str,
            request: int | None = None) -> NodeState:
    """The node state of that one pod (:func:`pod_infos`)."""
    state = NodeState()
    state.replace_all(*pod_infos(uid, level, cid, cgroups_path, request))
    return state
