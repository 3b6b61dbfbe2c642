"""`nri-qos probe`: the host probe the agent runs at start, reported with every feature's fate."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nri_plugin.cli.probe import main_probe
from reconciler.host.numa import read_meminfo, read_nodes
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from tests.support.fakesys import GIB, FakeHost
from tests.support.paths import REPO

REQUIRED_KEYS = {"memory_total_bytes", "numa_nodes", "cgroup", "resctrl", "psi", "features",
                 "warnings"}


def run_probe(tmp_path: Path, root: Path, extra: str = "") -> dict[str, Any]:
    config = tmp_path / "probe.toml"
    config.write_text(f'[reconciler]\nroot = "{root}"\n[kubernetes]\nenabled = false\n{extra}')
    out = io.StringIO()
    assert main_probe(str(config), as_json=True, out=out) == 0
    found: dict[str, Any] = json.loads(out.getvalue())
    assert found.keys() >= REQUIRED_KEYS
    return found


def test_fake_v2_host_with_resctrl(tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host", version=2, driver="systemd")
    host.set_numa([(20 * GIB, 32 * GIB, 100), (20 * GIB, 32 * GIB, 100)])
    host.make_resctrl()
    (host.tier_dir("guaranteed") / "memory.reclaim").write_text("")
    found = run_probe(tmp_path, host.root)
    assert found["memory_total_bytes"] == 64 * GIB
    assert [n["id"] for n in found["numa_nodes"]] == [0, 1]
    assert found["cgroup"] == {"version": 2, "driver": "systemd", "mount": "/sys/fs/cgroup",
                               "awaiting_kubelet": False}
    resctrl = found["resctrl"]
    assert (resctrl["mounted"], resctrl["num_closids"], resctrl["l3"], resctrl["mba"]) == (
        True, 8, True, True)
    memcg = found["memcg"]
    assert (memcg["reclaim"], memcg["force_empty"]) == (True, False)
    features = found["features"]
    assert features["resctrl"]["runs"] is True
    assert features["reconciler.numa_binding"]["runs"] is True
    assert features["memory_qos"]["runs"] is True
    assert features["kubernetes"] == {"runs": False,
                                      "detail": "kubernetes.enabled is false: NRI data only"}
    assert found["warnings"] == []


def test_fake_v1_host_without_resctrl_says_why(tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host", version=1)
    host.set_numa([(20 * GIB, 32 * GIB, 100)])
    found = run_probe(tmp_path, host.root)
    assert found["cgroup"] == {"version": 1, "driver": "cgroupfs", "mount": "/sys/fs/cgroup",
                               "awaiting_kubelet": False}
    features = found["features"]
    assert features["resctrl"] == {"runs": False,
                                   "detail": "resctrl is not mounted at /sys/fs/resctrl"}
    assert features["reconciler.numa_binding"] == {"runs": False,
                                                   "detail": "one NUMA node: nothing to bind"}
    assert "cgroup v1" in features["memory_qos"]["detail"]
    off = run_probe(tmp_path, host.root, "[resctrl]\nenabled = false\n")
    assert off["features"]["resctrl"]["detail"] == "resctrl.enabled is false"


def test_hot_added_memory_is_a_warning_and_the_system_figure_is_used(tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host")
    host.set_numa([(3 * GIB, 4 * GIB, 100)])
    (host.root / "proc/meminfo").write_text(
        f"MemTotal:       {24 * GIB // 1024} kB\nMemFree:        {20 * GIB // 1024} kB\n")
    found = run_probe(tmp_path, host.root)
    assert found["memory_total_bytes"] == 24 * GIB
    assert found["numa_view_consistent"] is False
    [warning] = found["warnings"]
    assert "adds up to 4294967296 bytes but /proc/meminfo says 25769803776 bytes" in warning


def test_unreadable_meminfo_falls_back_to_the_nodes(tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host")
    host.set_numa([(3 * GIB, 4 * GIB, 100)])
    (host.root / "proc/meminfo").unlink()
    info = probe_host(SysFs(host.root))
    assert info.memory_total_bytes == 4 * GIB
    assert "unreadable" in info.warnings[0]


def test_a_zoneinfo_not_understood_is_a_warning_not_a_failure(tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host")
    host.set_numa([(3 * GIB, 4 * GIB, 100)])
    (host.root / "proc/zoneinfo").write_text("Node 0, zone   Normal\n  pages free     5\n")
    info = probe_host(SysFs(host.root))
    assert info.numa_nodes == ()
    unreadable, view = info.warnings
    assert unreadable.startswith("the NUMA nodes' memory is unreadable (zone Normal of node 0 "
                                 "lacks")
    assert view.startswith("NUMA nodes' MemTotal adds up to 0 bytes")  # /proc/meminfo is used


def test_invalid_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[reconciler]\nroot = 5\n")
    assert main_probe(str(config), as_json=True) == 2
    assert "reconciler.root: must be a string" in capsys.readouterr().err


@pytest.mark.real_kernel
def test_this_machine(tmp_path: Path) -> None:
    """The acceptance check: the figure node-wide limits use is within 5 % of MemTotal, and a
    per-node view that does not add up is reported."""
    done = subprocess.run([sys.executable, "-m", "nri_plugin", "probe", "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found.keys() >= REQUIRED_KEYS
    sysfs = SysFs("/")
    total = read_meminfo(sysfs)["MemTotal"]
    assert abs(found["memory_total_bytes"] - total) <= total * 0.05
    nodes_total = sum(n.total_bytes for n in read_nodes(sysfs, 4096))
    if abs(nodes_total - total) > total * 0.10:
        assert any("NUMA nodes' MemTotal" in w for w in found["warnings"])
    human = subprocess.run([sys.executable, "-m", "nri_plugin", "probe"],
                           capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert human.returncode == 0
    assert "features" in human.stdout
