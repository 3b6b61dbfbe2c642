"""A pod's anonymous memory from its memory cgroup, on fake trees of both cgroup versions and on
this machine's real v1 hierarchy."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.host.cgroups import CgroupLayout
from reconciler.host.memstat import anon_bytes, pod_anon_bytes
from reconciler.host.sysfs import SysFs
from tests.support.fakesys import FakeHost

GIB = 1 << 30
REAL_V1 = Path("/sys/fs/cgroup/memory/memory.stat")


def test_v1_uses_the_hierarchical_rss() -> None:
    stat = "cache 5\nrss 0\nrss_huge 0\ntotal_cache 4096\ntotal_rss 8192\ntotal_rss_huge 2048\n"
    # total_rss already counts the huge pages: they are not added again.
    assert anon_bytes(stat, v2=False) == 8192
    assert anon_bytes("cache 1\nrss 12288\n", v2=False) == 12288


def test_v2_uses_anon() -> None:
    assert anon_bytes("anon 4096\nfile 99999\nanon_thp 0\n", v2=True) == 4096
    assert anon_bytes("total_rss 4096\n", v2=True) is None


def test_tier_anonymous_of_each_version() -> None:
    assert anon_bytes("cache 5\nrss 0\ntotal_rss 77\n", v2=False) == 77
    assert anon_bytes("anon 12\nfile 5\n", v2=True) == 12
    assert anon_bytes("", v2=True) is anon_bytes("garbage", v2=False) is None


@pytest.mark.parametrize("text", ["", "anon\n", "anon x\n", "anon -5\n", "garbage"])
def test_unusable_text(text: str) -> None:
    assert anon_bytes(text, v2=True) is None


@pytest.mark.parametrize(("version", "driver"), [(1, "cgroupfs"), (2, "systemd")])
def test_pod_anon_on_fake_trees(tmp_path: Path, version: int, driver: str) -> None:
    host = FakeHost(tmp_path, version=version, driver=driver)
    pod = host.add_pod("12345678-aaaa-bbbb-cccc-1234567890ab", tier="besteffort")
    layout = CgroupLayout(version, driver)
    sysfs = SysFs(tmp_path)
    assert pod_anon_bytes(sysfs, layout, pod.info.cgroup_parent) is None  # no memory.stat yet
    host.set_pod_anon(pod, 3 * GIB, cache=GIB)
    assert pod_anon_bytes(sysfs, layout, pod.info.cgroup_parent) == 3 * GIB
    assert pod_anon_bytes(sysfs, layout, "../escape") is None
    assert pod_anon_bytes(sysfs, layout, "") is None


@pytest.mark.real_kernel
@pytest.mark.skipif(not REAL_V1.exists(), reason="no cgroup v1 memory controller here")
def test_real_v1_root_memory_stat_parses() -> None:
    text = SysFs("/").read(str(REAL_V1))
    assert text is not None
    value = anon_bytes(text, v2=False)
    assert value is not None
    assert value > 0
