"""One pod's container memcg made under this machine's cgroup v1 memory hierarchy, for tests of
what drift and the guard write to the kernel.

:func:`container_memcg` builds ``<test parent>/memory/kubepods/<tier>/pod<uid>/<id>`` under
``/sys/fs/cgroup/memory`` with ``sleep`` processes in the container memcg; a reconciler whose
cgroup layout is mounted at the test parent writes in that subtree and nowhere else.
:data:`NEEDS_V1_MEMORY` skips a module unless running as root with the v1 memory controller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo

MEMORY_V1 = Path("/sys/fs/cgroup/memory")

NEEDS_V1_MEMORY = [pytest.mark.real_kernel, pytest.mark.skipif(
    os.geteuid() != 0 or not (MEMORY_V1 / "memory.limit_in_bytes").is_file(),
    reason="needs root and the cgroup v1 memory controller")]


@dataclasses.dataclass
class Subtree:
    parent: Path
    """The test parent: the reconciler's cgroup mount."""
    tier: Path
    container: Path
    processes: list[subprocess.Popen[bytes]]


@contextlib.contextmanager
def container_memcg(name: str, tier: str, uid: str, cid: str, *, processes: int = 1,
                    oom_score_adj: int | None = None) -> Iterator[Subtree]:
    """The subtree under ``/sys/fs/cgroup/memory/<name>-<pid>``, with ``processes`` sleeps in
    the container memcg (given ``oom_score_adj`` first, as the runtime gives kubelet's score);
    the processes killed and the memcgs removed on leaving."""
    parent = MEMORY_V1 / f"{name}-{os.getpid()}"
    tier_dir = parent / "memory/kubepods" / tier
    container = tier_dir / f"pod{uid}" / cid
    container.mkdir(parents=True)
    procs = [subprocess.Popen(["sleep", "300"]) for _ in range(processes)]
    try:
        for proc in procs:
            if oom_score_adj is not None:
                Path(f"/proc/{proc.pid}/oom_score_adj").write_text(str(oom_score_adj))
            (container / "cgroup.procs").write_text(str(proc.pid))
        yield Subtree(parent, tier_dir, container, procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for d in (container, container.parent, tier_dir, tier_dir.parent, tier_dir.parent.parent,
                  parent):
            if d.is_dir():
                d.rmdir()


def one_container(tier: str, uid: str, cid: str, *, memory_request: int | None = None,
                  oom_score_adj: int | None = None) -> NodeState:
    """The node state of pod ``real`` (namespace ``test``) under kubelet's cgroup of ``tier``,
    with the one container ``sleeper`` the runtime reports."""
    state = NodeState()
    pod = PodInfo(id="sandbox", uid=uid, name="real", namespace="test",
                  cgroup_parent=f"/kubepods/{tier}/pod{uid}")
    state.replace_all([pod], [ContainerInfo(
        id=cid, pod_sandbox_id="sandbox", name="sleeper",
        cgroups_path=f"/kubepods/{tier}/pod{uid}/{cid}", memory_request=memory_request,
        oom_score_adj=oom_score_adj)])
    return state
