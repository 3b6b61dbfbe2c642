"""Drift gives a container's cgroup v1 soft limit back when its level stops asking for one, on
this machine's kernel (cgroup v1 memory controller).

Builds ``<test parent>/memory/kubepods/besteffort/pod<uid>/<id>`` under
``/sys/fs/cgroup/memory`` with a ``sleep`` in the container memcg, and points the reconciler's
cgroup layout at the test parent, so every write lands in that subtree and nowhere else.
Skipped unless running as root on a host with the v1 memory controller.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import PodMeta
from common.state import NodeState
from hooks.config_fields import frozen_map
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.sysfs import SysFs
from reconciler.loops.drift import DriftLoop

MEMORY_V1 = Path("/sys/fs/cgroup/memory")
UID = "66666666-0000-4000-8000-000000000006"
CID = "e" * 64
MIB = 1 << 20

pytestmark = [pytest.mark.real_kernel, pytest.mark.skipif(
    os.geteuid() != 0 or not (MEMORY_V1 / "memory.limit_in_bytes").is_file(),
    reason="needs root and the cgroup v1 memory controller")]


@dataclasses.dataclass
class Subtree:
    parent: Path
    container: Path


@pytest.fixture
def subtree() -> Iterator[Subtree]:
    parent = MEMORY_V1 / f"nriqos-release-{os.getpid()}"
    tier = parent / "memory/kubepods/besteffort"
    container = tier / f"pod{UID}" / CID
    container.mkdir(parents=True)
    proc = subprocess.Popen(["sleep", "300"])
    try:
        (container / "cgroup.procs").write_text(str(proc.pid))
        yield Subtree(parent, container)
    finally:
        proc.kill()
        proc.wait()
        for d in (container, container.parent, tier, tier.parent, tier.parent.parent, parent):
            if d.is_dir():
                d.rmdir()


def reserving(reservation: bool) -> Config:
    """The defaults, with reclaimed_cores protecting half its request as the v1 soft limit."""
    base = Config()
    levels = dict(base.memory.levels)
    levels["reclaimed_cores"] = dataclasses.replace(
        levels["reclaimed_cores"], low_ratio=50, annotation_max_low_ratio=50,
        v1_reservation=reservation)
    return dataclasses.replace(base, memory=dataclasses.replace(
        base.memory, levels=frozen_map(levels)))


def drift(subtree: Subtree, runtimes: int | None) -> tuple[DriftLoop, list[Config]]:
    """A drift loop over the container, whose request of 64 MiB the API gives and the runtime
    gives as ``runtimes``, and its configuration, which the test swaps."""
    state = NodeState()
    pod = PodInfo(id="sandbox", uid=UID, name="real", namespace="test",
                  cgroup_parent=f"/kubepods/besteffort/pod{UID}")
    state.replace_all([pod], [ContainerInfo(
        id=CID, pod_sandbox_id="sandbox", name="sleeper",
        cgroups_path=f"/kubepods/besteffort/pod{UID}/{CID}", memory_request=runtimes)])
    state.apply_meta(PodMeta(uid=UID, namespace="test", name="real",
                             annotations=MappingProxyType({}), labels=MappingProxyType({}),
                             priority=0, memory_requests=MappingProxyType({"sleeper": 64 * MIB}),
                             memory_limits=MappingProxyType({})))
    sysfs = SysFs("/", AuditLog(MemoryAuditSink()))
    layout = CgroupLayout(1, "cgroupfs", mount=str(subtree.parent))
    config = [reserving(True)]
    return DriftLoop(lambda: config[0], state, sysfs, layout, 1 << 30), config


def test_the_soft_limit_drift_wrote_goes_back_to_the_kernels_value(subtree: Subtree) -> None:
    soft = subtree.container / "memory.soft_limit_in_bytes"
    before = soft.read_text()
    loop, config = drift(subtree, 64 * MIB)
    loop.cycle(0.0)
    assert int(soft.read_text()) == 32 * MIB
    config[0] = reserving(False)
    loop.cycle(10.0)
    assert soft.read_text() == before


def test_a_soft_limit_applied_at_creation_goes_back_to_unlimited(subtree: Subtree) -> None:
    soft = subtree.container / "memory.soft_limit_in_bytes"
    unlimited = soft.read_text()
    soft.write_text(str(32 * MIB))  # the runtime, from the agent's CreateContainer answer
    loop, config = drift(subtree, None)
    loop.cycle(0.0)
    loop.cycle(10.0)
    config[0] = dataclasses.replace(reserving(True), memory=dataclasses.replace(
        reserving(True).memory, enabled=False))
    loop.cycle(20.0)
    assert soft.read_text() == unlimited
