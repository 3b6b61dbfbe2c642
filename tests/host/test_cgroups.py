"""cgroup paths: both NRI forms, both drivers, tiers, version/driver detection, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.host.cgroups import (
    CgroupLayout,
    CgroupPathError,
    expand_slice,
    layout_for,
    parse_cgroups_path,
    pod_parent_rel,
    pod_rel,
    tier_rel,
)
from reconciler.host.sysfs import SysFs
from tests.support.fakesys import FakeHost

UID = "0f3c5a2e-1b7d-4c1e-9a8b-2d6e4f0a1b2c"
CID = "a" * 64


def test_cgroupfs_path() -> None:
    ref = parse_cgroups_path(f"/kubepods/burstable/pod{UID}/{CID}")
    assert ref.rel == f"kubepods/burstable/pod{UID}/{CID}"
    assert (ref.driver, ref.tier, ref.pod_uid) == ("cgroupfs", "burstable", UID)
    assert pod_rel(ref) == f"kubepods/burstable/pod{UID}"


def test_cgroupfs_guaranteed_and_foreign_paths() -> None:
    assert parse_cgroups_path(f"/kubepods/pod{UID}/{CID}").tier == "guaranteed"
    foreign = parse_cgroups_path("/system.slice/containerd.service")
    assert (foreign.tier, foreign.pod_uid) == (None, None)


def test_systemd_path() -> None:
    slice_uid = UID.replace("-", "_")
    ref = parse_cgroups_path(f"kubepods-burstable-pod{slice_uid}.slice:cri-containerd:{CID}")
    assert ref.rel == ("kubepods.slice/kubepods-burstable.slice/"
                       f"kubepods-burstable-pod{slice_uid}.slice/cri-containerd-{CID}.scope")
    assert (ref.driver, ref.tier, ref.pod_uid) == ("systemd", "burstable", UID)


def test_systemd_guaranteed_and_besteffort() -> None:
    g = parse_cgroups_path(f"kubepods-pod{UID.replace('-', '_')}.slice:cri-containerd:{CID}")
    assert g.rel.startswith("kubepods.slice/kubepods-pod")
    assert g.tier == "guaranteed"
    be = parse_cgroups_path(f"kubepods-besteffort-podabc.slice:crio:{CID}")
    assert be.tier == "besteffort"
    assert be.rel.endswith(f"/crio-{CID}.scope")


def test_expand_slice() -> None:
    assert expand_slice("a-b-c.slice") == ["a.slice", "a-b.slice", "a-b-c.slice"]
    assert expand_slice("-.slice") == []
    for bad in ("a--b.slice", "-a.slice", "a.scope", ".slice"):
        with pytest.raises(CgroupPathError):
            expand_slice(bad)


@pytest.mark.parametrize("bad", [
    "", "   ", "/", "/kubepods/../../etc", "/kubepods//x", "/kubepods/./x",
    "kubepods.slice:cri-containerd", "a.slice:b:c:d", "kubepods-x.slice:cri:../../x",
    "kubepods-x.slice:cri:a/b", "kubepods.slice:cri:", "/kubepods/pod x/y", "/a\0b",
])
def test_bad_paths_are_rejected(bad: str) -> None:
    with pytest.raises(CgroupPathError):
        parse_cgroups_path(bad)


def test_tier_dirs() -> None:
    assert tier_rel("cgroupfs", "besteffort") == "kubepods/besteffort"
    assert tier_rel("cgroupfs", "guaranteed") == "kubepods"
    assert tier_rel("systemd", "burstable") == "kubepods.slice/kubepods-burstable.slice"
    assert tier_rel("systemd", "guaranteed") == "kubepods.slice"
    with pytest.raises(ValueError, match="tier"):
        tier_rel("systemd", "gold")
    with pytest.raises(ValueError, match="driver"):
        tier_rel("other", "burstable")


def test_layout_dirs_per_version() -> None:
    v1 = CgroupLayout(1, "cgroupfs")
    assert v1.dir("memory", "kubepods") == "/sys/fs/cgroup/memory/kubepods"
    assert v1.tier_dir("memory", "besteffort") == "/sys/fs/cgroup/memory/kubepods/besteffort"
    assert v1.threads_file == "tasks"
    assert v1.limit_file == "memory.limit_in_bytes"
    v2 = CgroupLayout(2, "systemd")
    assert v2.dir("memory", "kubepods.slice") == "/sys/fs/cgroup/kubepods.slice"
    assert v2.tier_dir("cpuset", "besteffort") == \
        "/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice"
    assert v2.threads_file == "cgroup.threads"
    assert v2.limit_file == "memory.max"


@pytest.mark.parametrize(("version", "driver"), [(1, "cgroupfs"), (2, "systemd"),
                                                  (1, "systemd"), (2, "cgroupfs")])
def test_detection_on_fake_hosts(tmp_path: Path, version: int, driver: str) -> None:
    FakeHost(tmp_path, version=version, driver=driver)
    layout = layout_for(SysFs(tmp_path))
    assert (layout.version, layout.driver) == (version, driver)


def test_overrides_win(tmp_path: Path) -> None:
    FakeHost(tmp_path, version=2, driver="systemd")
    layout = layout_for(SysFs(tmp_path), "v1", "cgroupfs")
    assert (layout.version, layout.driver) == (1, "cgroupfs")
    with pytest.raises(ValueError, match="version"):
        layout_for(SysFs(tmp_path), "v3")


def test_fake_host_container_paths_resolve(tmp_path: Path) -> None:
    for version, driver in ((1, "cgroupfs"), (2, "systemd")):
        host = FakeHost(tmp_path / driver, version=version, driver=driver)
        pod = host.add_pod(UID, tier="besteffort")
        container = pod.containers[0]
        ref = parse_cgroups_path(container.info.cgroups_path)
        assert ref.rel == container.rel
        layout = CgroupLayout(version, driver)
        tasks = SysFs(host.root).read_ids(f"{layout.dir('cpu', ref.rel)}/{layout.threads_file}")
        assert tasks == container.tids


@pytest.mark.parametrize(("parent", "rel"), [
    ("/kubepods/besteffort/pod1234", "kubepods/besteffort/pod1234"),
    ("/kubepods/pod1234", "kubepods/pod1234"),
    ("kubepods-besteffort-pod12_34.slice",
     "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod12_34.slice"),
    ("kubepods-pod12_34.slice", "kubepods.slice/kubepods-pod12_34.slice"),
])
def test_pod_parent_rel(parent: str, rel: str) -> None:
    assert pod_parent_rel(parent) == rel


@pytest.mark.parametrize("bad", ["", "  ", "/kubepods/../etc", "a/b", "x:y:z", "plain",
                                 "/kubepods//pod1"])
def test_pod_parent_rel_rejects(bad: str) -> None:
    with pytest.raises(CgroupPathError):
        pod_parent_rel(bad)


@pytest.mark.parametrize(("version", "driver"), [(1, "cgroupfs"), (2, "systemd")])
def test_fake_host_pod_parents_resolve(tmp_path: Path, version: int, driver: str) -> None:
    host = FakeHost(tmp_path, version=version, driver=driver)
    pod = host.add_pod("12345678-aaaa-bbbb-cccc-1234567890ab", tier="besteffort")
    assert pod_parent_rel(pod.info.cgroup_parent) == host.pod_rel("besteffort", pod.info.uid)
