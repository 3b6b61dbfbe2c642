"""An agent started before kubelet (at a node's boot, run by systemd) finds no pods cgroup to
probe cgroup triggers on: it says so, and probes again once kubelet has made the cgroup, so the
online pods get their own triggers without a restart. Fake v2 tree (this machine runs cgroup v1);
triggers armed through the injected ``arm``, as in ``test_pod_triggers.py``."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import structlog

from reconciler.detection.triggers import PodTriggers, pod_trigger_problem
from reconciler.host.probe import probe_host
from tests.support.detection_env import Setup, uid
from tests.support.fakesys import GIB

NOT_YET = "kubelet's pods cgroup is not there yet: probed again once it is"
WINDOW_US = 500_000


class FakeTrigger:
    """A trigger that never fires (an eventfd nobody signals), taken on every file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.eventfd(0, os.EFD_NONBLOCK)
        self.closed = False

    def fileno(self) -> int:
        return self.fd

    def gone(self) -> bool:
        return False

    def close(self) -> None:
        os.close(self.fd)
        self.closed = True


class Arms:
    def __init__(self) -> None:
        self.made: list[FakeTrigger] = []

    def __call__(self, path: str, stall_us: int, window_us: int) -> FakeTrigger:
        self.made.append(FakeTrigger(path))
        return self.made[-1]


def before_kubelet(tmp_path: Path) -> tuple[Setup, Path]:
    """The fake v2 node with no kubepods cgroup; its path."""
    s = Setup(tmp_path, version=2)
    kubepods = s.host.cg("", s.host.tier_rel("guaranteed"))
    shutil.rmtree(kubepods)
    return s, kubepods


def kubelet_starts(s: Setup, kubepods: Path) -> None:
    """kubelet makes its cgroups and an online pod starts in them."""
    s.pod("web", "shared_cores", request=GIB, anon=0, tier="burstable")
    # The kernel gives every cgroup its pressure file.
    (kubepods / "memory.pressure").write_text(
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


def test_the_probe_says_kubelets_pods_cgroup_is_not_there_yet(tmp_path: Path) -> None:
    s, _kubepods = before_kubelet(tmp_path)
    host = probe_host(s.sysfs, cgroup_driver="systemd")
    assert host.pod_psi
    assert pod_trigger_problem(s.cfg, host) == NOT_YET


async def test_online_pods_get_triggers_once_kubelet_has_made_its_cgroup(
        tmp_path: Path) -> None:
    s, kubepods = before_kubelet(tmp_path)
    host = probe_host(s.sysfs, cgroup_driver="systemd")
    arms = Arms()
    triggers = PodTriggers(lambda: s.cfg, s.state, s.sysfs, host, arm=arms)
    loop = asyncio.get_running_loop()
    with structlog.testing.capture_logs() as logs:
        triggers.sync(loop, lambda: None)
        assert not triggers.complete()
        kubelet_starts(s, kubepods)
        triggers.sync(loop, lambda: None)
    assert triggers.armed() == {uid("web")}
    assert triggers.complete()
    said = [e["reason"] for e in logs if e["event"] == "pod_triggers_unavailable"]
    assert said == [NOT_YET]
    [probed] = [e for e in logs if e["event"] == "cgroup_triggers_probed"]
    assert (probed["window_ms"], probed["problem"]) == (WINDOW_US // 1000, "")
    # The probe's trigger was disarmed at once; the pod's is the one left.
    probe, pod = arms.made
    assert (probe.path, probe.closed) == (f"/sys/fs/cgroup/{kubepods.name}/memory.pressure", True)
    assert (pod.path, pod.closed) == (
        f"/sys/fs/cgroup/{s.host.pod_rel('burstable', uid('web'))}/memory.pressure", False)
