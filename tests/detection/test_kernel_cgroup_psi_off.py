"""cgroup v2 with PSI on for the node but off for cgroups (``cgroup_disable=pressure``, or
``cgroup.pressure`` set to 0): the pods have no ``memory.pressure``. On the real kernel: a fresh
cgroup tree of this machine's v2 hierarchy, each cgroup's ``cgroup.pressure`` set to 0, which
removes its pressure files as the boot option removes every cgroup's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from bench.kubelet_node import remove_cgroup
from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.cli.probe import report
from nri_plugin.config.schema import Config
from reconciler.detection.publisher import Publisher
from reconciler.detection.service import DetectorsLoop
from reconciler.detection.signals import Board
from reconciler.host.probe import HostInfo, probe_host
from reconciler.host.sysfs import SysFs

pytestmark = pytest.mark.real_kernel

UNIFIED = Path("/sys/fs/cgroup/unified")
UID = "0c0c0c0c-0000-4000-8000-000000000001"
CID = "c" * 64
PODS = ("kubepods.slice", "kubepods.slice/kubepods-burstable.slice",
        "kubepods.slice/kubepods-besteffort.slice",
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{UID.replace('-', '_')}.slice")


def v2_tree() -> Path | None:
    """Where a cgroup v2 hierarchy of this machine is mounted (a hybrid host's ``unified``)."""
    for where in (Path("/sys/fs/cgroup"), UNIFIED):
        if (where / "cgroup.controllers").is_file() and (where / "cgroup.pressure").is_file():
            return where
    return None


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    tree = v2_tree()
    if os.geteuid() != 0 or tree is None:
        pytest.skip("needs root and a cgroup v2 hierarchy with cgroup.pressure (Linux 6.1+)")
    top = tree / f"nriqos-kernel-psi-{os.getpid()}"
    made = [top]
    top.mkdir()
    try:
        for rel in PODS:
            made.append(top / rel)
            (top / rel).mkdir()
        for cgroup in made:
            (cgroup / "cgroup.pressure").write_text("0\n")
        assert not (top / PODS[0] / "memory.pressure").exists()
        base = tmp_path / "root"
        (base / "sys/fs").mkdir(parents=True)
        (base / "sys/fs/cgroup").symlink_to(top)
        (base / "proc").symlink_to("/proc")
        (base / "sys/devices").symlink_to("/sys/devices")
        yield base
    finally:
        for cgroup in reversed(made):
            remove_cgroup(cgroup)


def probed(root: Path) -> HostInfo:
    return probe_host(SysFs(root, AuditLog(MemoryAuditSink())), cgroup_version="v2",
                      cgroup_driver="systemd")


def test_pods_without_memory_pressure_have_no_psi_of_their_own(root: Path) -> None:
    host = probed(root)
    assert host.psi.readable  # the node's PSI is on
    assert not host.pod_psi
    psi = report(Config(), host)["features"]["detection.psi"]
    assert "no memory.pressure" in psi["detail"]
    assert "each online pod's memory.pressure" not in psi["detail"]


def test_online_pods_without_memory_pressure_get_no_unknown_psi_readings(root: Path) -> None:
    host = probed(root)
    sink = MemoryAuditSink()
    state = NodeState()
    pod = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" \
          f"{UID.replace('-', '_')}.slice"
    state.replace_all(
        [PodInfo(id="sandbox", uid=UID, name="online", namespace="default",
                 annotations={"qos.nri-qos.io/level": "shared_cores"},
                 cgroup_parent=pod.rsplit("/", 1)[1])],
        [ContainerInfo(id=CID, pod_sandbox_id="sandbox", name="c",
                       cgroups_path=f"{pod.rsplit('/', 1)[1]}:cri-containerd:{CID}", pid=1)])
    cfg = Config()
    board = Board()
    publisher = Publisher(board, AuditLog(sink), lambda: cfg.detection)
    loop = DetectorsLoop(lambda: cfg, publisher, state, SysFs(root), host)
    with capture_logs():
        loop.cycle(0.0)
        loop.cycle(1.0)
    assert [r for r in board.current() if r.key[0] == "psi"] == []
    assert sink.named("detector_unknown") == []
