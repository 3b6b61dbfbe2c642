"""What the DaemonSet grants the agent beyond root with DAC_OVERRIDE and SYS_RESOURCE, and why:
the NUMA balance's move_pages(2), run as the DaemonSet runs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.manifests import Doc, base_docs, container_of, one
from tests.support.paths import REPO


@pytest.fixture(scope="module")
def daemonset() -> Doc:
    return one(base_docs(), "DaemonSet")


_MOVE_ONE_STEP = (
    "import sys\n"
    "from reconciler.host.sysfs import SysFs\n"
    "pids = [int(sys.argv[1])]\n"
    "outcome, moved, why = SysFs('/').move_pages_bounded(pids, 0, 0, 4 << 20, 10.0)\n"
    "print(outcome.value, moved, why)\n"
)
"""One NUMA balance step's move (node 0 to node 0: every page found moves in place)."""


def _move_one_step(pid: int, capabilities: list[str] | None) -> tuple[str, int, str]:
    """The step's outcome, bytes moved and why, run as root with only ``capabilities`` (None:
    those of this process)."""
    command = [sys.executable, "-c", _MOVE_ONE_STEP, str(pid)]
    if capabilities is not None:
        kept = "".join(f",+{name.lower()}" for name in capabilities)
        command = ["setpriv", f"--bounding-set=-all{kept}", "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True,
                          timeout=60)
    outcome, moved, why = done.stdout.rstrip("\n").split(" ", 2)
    return outcome, int(moved), why


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None
                    or not Path("/sys/devices/system/node/node0").is_dir()
                    or os.uname().machine not in ("x86_64", "aarch64"),
                    reason="needs root, setpriv, a NUMA node and move_pages(2)")
def test_the_daemonsets_capabilities_let_the_numa_balance_move_pages(daemonset: Doc) -> None:
    """The NUMA balance moves a reclaimed pod's pages with move_pages(2) and MPOL_MF_MOVE_ALL
    (CAP_SYS_NICE), after reading the processes' /proc/<pid>/maps and asking where their pages
    are (ptrace read access: CAP_SYS_PTRACE for a process of another user, as pods' processes
    mostly are). Run as the DaemonSet runs it: root with only the capabilities it adds."""
    added = container_of(daemonset)["securityContext"]["capabilities"]["add"]
    target = subprocess.Popen(["sleep", "60"], user=65534, group=65534, extra_groups=[])
    try:
        control = _move_one_step(target.pid, None)
        if control[0] != "written" or control[1] == 0:
            pytest.skip(f"this machine does not move pages even with every capability: {control}")
        outcome, moved, why = _move_one_step(target.pid, added)
    finally:
        target.kill()
        target.wait()
    assert (outcome, why) == ("written", "")
    assert moved > 0


def test_the_daemonsets_seccomp_profile_lets_the_numa_balance_call_move_pages(
        daemonset: Doc) -> None:
    """containerd's RuntimeDefault profile (Docker's), which a kubelet with SeccompDefault
    applies to a container that names none, has no rule for move_pages(2), with or without
    CAP_SYS_NICE: every NUMA balance step would fail EPERM."""
    security = container_of(daemonset)["securityContext"]
    assert security["seccompProfile"] == {"type": "Unconfined"}
