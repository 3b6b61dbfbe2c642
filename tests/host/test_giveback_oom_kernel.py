"""Drift gives a container's processes kubelet's oom_score_adj back when no policy asks for a score
any more, on this machine's kernel: real processes in a cgroup v1 memory cgroup, their real
``/proc/<pid>/oom_score_adj``.

Builds ``<test parent>/memory/kubepods/burstable/pod<uid>/<id>`` under ``/sys/fs/cgroup/memory``
with two ``sleep`` processes in the container memcg, given kubelet's score as the runtime gives
it, and points the reconciler's cgroup layout at the test parent, so the processes drift
writes to are these two and no other. Skipped unless running as root on a host with the v1 memory
controller.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import PodMeta
from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.sysfs import SysFs
from reconciler.loops.drift import DriftLoop

MEMORY_V1 = Path("/sys/fs/cgroup/memory")
UID = "99999999-0000-4000-8000-000000000009"
CID = "f" * 64
KUBELETS = 300
OOM = "qos.nri-qos.io/oom-score-adj"
LEVEL = "qos.nri-qos.io/level"

pytestmark = [pytest.mark.real_kernel, pytest.mark.skipif(
    os.geteuid() != 0 or not (MEMORY_V1 / "memory.limit_in_bytes").is_file(),
    reason="needs root and the cgroup v1 memory controller")]


class Container:
    """The container's processes and a drift loop over it; ``meta`` gives the pod annotations
    through the API, ``observe`` switches the node to observe mode."""

    def __init__(self, parent: Path, pids: list[int]) -> None:
        self.pids = pids
        self.observe = False
        self.state = NodeState()
        pod = PodInfo(id="sandbox", uid=UID, name="real", namespace="test",
                      cgroup_parent=f"/kubepods/burstable/pod{UID}")
        self.state.replace_all([pod], [ContainerInfo(
            id=CID, pod_sandbox_id="sandbox", name="sleeper",
            cgroups_path=f"/kubepods/burstable/pod{UID}/{CID}", oom_score_adj=KUBELETS)])
        sysfs = SysFs("/", AuditLog(MemoryAuditSink())).observing(lambda: self.observe)
        layout = CgroupLayout(1, "cgroupfs", mount=str(parent))
        config = Config()
        self.loop = DriftLoop(lambda: config, self.state, sysfs, layout, 1 << 30)
        self.now = 0.0

    def meta(self, annotations: dict[str, str]) -> None:
        self.state.apply_meta(PodMeta(uid=UID, namespace="test", name="real",
                                      annotations=MappingProxyType(annotations),
                                      labels=MappingProxyType({}), priority=0,
                                      memory_requests=MappingProxyType({}),
                                      memory_limits=MappingProxyType({})))

    def cycle(self) -> list[int]:
        """The processes' scores after one cycle."""
        self.now += 10.0
        self.loop.cycle(self.now)
        return [int(Path(f"/proc/{pid}/oom_score_adj").read_text()) for pid in self.pids]


@pytest.fixture
def container() -> Iterator[Container]:
    parent = MEMORY_V1 / f"nriqos-giveback-oom-{os.getpid()}"
    tier = parent / "memory/kubepods/burstable"
    cgroup = tier / f"pod{UID}" / CID
    cgroup.mkdir(parents=True)
    procs = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    try:
        for proc in procs:
            Path(f"/proc/{proc.pid}/oom_score_adj").write_text(str(KUBELETS))  # the runtime's
            (cgroup / "cgroup.procs").write_text(str(proc.pid))
        yield Container(parent, [proc.pid for proc in procs])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for d in (cgroup, cgroup.parent, tier, tier.parent, tier.parent.parent, parent):
            if d.is_dir():
                d.rmdir()


def test_an_annotations_score_goes_back_to_kubelets_when_it_is_removed(
        container: Container) -> None:
    container.meta({OOM: "500"})
    assert container.cycle() == [500, 500]
    container.meta({})
    assert container.cycle() == [KUBELETS, KUBELETS]


def test_a_level_moved_and_moved_back_gives_kubelets_score_back(container: Container) -> None:
    container.meta({LEVEL: "reclaimed_cores"})
    assert container.cycle() == [1000, 1000]
    container.meta({})
    assert container.cycle() == [KUBELETS, KUBELETS]


def test_observe_mode_gives_the_score_back_and_enforce_writes_it_again(
        container: Container) -> None:
    container.meta({OOM: "500"})
    assert container.cycle() == [500, 500]
    Path(f"/proc/{container.pids[1]}/oom_score_adj").write_text("700")  # someone else's
    container.observe = True
    assert container.cycle() == [KUBELETS, 700]
    assert container.cycle() == [KUBELETS, 700]
    container.observe = False
    assert container.cycle() == [500, 500]
