"""Which driver kubelet's pods cgroup says, and a layout that cannot tell yet: a node whose
kubelet has not started, on both cgroup versions (fake trees)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from reconciler.host.cgroups import kubelet_driver, layout_for
from reconciler.host.sysfs import SysFs
from tests.support.fakesys import FakeHost


@pytest.mark.parametrize(("version", "driver"), [(1, "cgroupfs"), (1, "systemd"),
                                                  (2, "cgroupfs"), (2, "systemd")])
def test_the_driver_is_known_once_kubelet_has_made_its_pods_cgroup(
        tmp_path: Path, version: int, driver: str) -> None:
    host = FakeHost(tmp_path, version=version, driver=driver)
    sysfs = SysFs(tmp_path)
    assert kubelet_driver(sysfs, version) == driver
    assert not layout_for(sysfs).awaiting_kubelet
    pods = host.cg("memory", "kubepods.slice" if driver == "systemd" else "kubepods")
    shutil.rmtree(pods)
    assert kubelet_driver(sysfs, version) is None
    assert layout_for(sysfs).awaiting_kubelet


@pytest.mark.parametrize("driver", ["cgroupfs", "systemd"])
def test_an_explicit_driver_never_waits_for_kubelet(tmp_path: Path, driver: str) -> None:
    host = FakeHost(tmp_path, version=2, driver="systemd")
    shutil.rmtree(host.cg("", "kubepods.slice"))
    layout = layout_for(SysFs(tmp_path), "auto", driver)
    assert (layout.driver, layout.awaiting_kubelet) == (driver, False)
