"""Idle CPU priority on this machine's cgroup v1 kernel: the agent's loop, reading and writing
the real ``cpu`` hierarchy (a fresh child of it stands for the node's), sets ``cpu.idle`` on the
BestEffort tier; a busy offline task then gets next to none of a CPU an online one wants (half
of it before), and the tier has its value back when the agent stops. Skipped without root or
without ``cpu.idle`` (Linux 5.15+) in the v1 cpu hierarchy."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.realroot import end, in_cgroup
from tests.support.spinners import idle_tier_yields

CPU_V1 = Path("/sys/fs/cgroup/cpu")
SPIN_S = 3.0


def unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root"
    if not (CPU_V1 / "cpu.idle").is_file():
        return "needs cpu.idle in the cgroup v1 cpu hierarchy (Linux 5.15+)"
    return ""


pytestmark = [pytest.mark.real_kernel,
              pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "available")]


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """A host root whose cpu hierarchy is a fresh child of the machine's, with kubelet's tiers."""
    node = CPU_V1 / f"nriqos-test-{os.getpid()}-{tmp_path.name}"
    made = [node]
    node.mkdir()
    for rel in ("kubepods", "kubepods/burstable", "kubepods/besteffort",
                "kubepods/burstable/podonline", "kubepods/besteffort/podoffline"):
        (node / rel).mkdir()
        made.append(node / rel)
    root = tmp_path / "root"
    (root / "sys/fs/cgroup").mkdir(parents=True)
    (root / "sys/fs/cgroup/cpu").symlink_to(node)
    try:
        yield root
    finally:
        end([], made)


def spawn(cgroup: Path, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    return subprocess.Popen(in_cgroup(cgroup, argv), **kwargs)


@pytest.mark.timeout(60)
def test_the_idle_tier_yields_the_cpu_and_gets_its_priority_back(root: Path) -> None:
    node = root / "sys/fs/cgroup/cpu"
    idle_tier_yields(spawn, node / "kubepods/burstable/podonline",
                     node / "kubepods/besteffort/podoffline",
                     node / "kubepods/besteffort/cpu.idle", root, SPIN_S)


def test_the_kernel_refuses_a_cpu_weight_to_an_idle_tier(root: Path) -> None:
    """Why the feature is off by default besides its cost: kubelet writes the tiers' weights
    (v1 ``cpu.shares``) every minute, and the kernel refuses one to an idle cgroup."""
    tier = root / "sys/fs/cgroup/cpu/kubepods/besteffort"
    (tier / "cpu.shares").write_text("2\n")
    (tier / "cpu.idle").write_text("1\n")
    try:
        with pytest.raises(OSError, match="Invalid argument"):
            (tier / "cpu.shares").write_text("2\n")
    finally:
        (tier / "cpu.idle").write_text("0\n")
    (tier / "cpu.shares").write_text("2\n")
