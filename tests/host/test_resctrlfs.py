"""resctrl filesystem layer on fake Intel and AMD trees."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from hooks.resctrl import Allocation, ResctrlInfo, build_schemata
from reconciler.host.resctrl_files import parse_schemata, schemata_matches, schemata_text
from reconciler.host.resctrlfs import GroupError, ResctrlFs, read_info
from reconciler.host.sysfs import SysFs
from tests.support.resctrl_trees import amd_tree, intel_tree
from tests.support.tmpfs import tmpfs

CLASS_GROUPS = ["nriqos-dedicated_cores", "nriqos-shared_cores", "nriqos-reclaimed_cores",
                "nriqos-system_cores"]


INTEL = ResctrlInfo(num_closids=16, cbm_mask=0x7FF, min_cbm_bits=1, l3_ids=(0, 1), mb_ids=(0, 1),
                    mb_gran=10, mb_min=10, monitoring=True)


class Env:
    """A resctrl tree mounted at ``root`` itself: the sysfs layer is rooted there too."""

    def __init__(self, root: Path) -> None:
        self.sink = MemoryAuditSink()
        self.warnings: list[str] = []
        self.root = root
        audit = AuditLog(self.sink)
        self.fs = ResctrlFs.detect(SysFs(root, audit), "/", prefix="nriqos-", audit=audit,
                                   amd_mb_max=2048, warn=self.warnings.append)


def test_schemata_text_and_readback() -> None:
    s = build_schemata(Allocation(l3=(0, 30), mb=20), INTEL)
    assert schemata_text(s) == "L3:0=f;1=f\nMB:0=20;1=20\n"
    # The kernel pads masks and right-aligns names; values, not text, are compared.
    assert schemata_matches(s, parse_schemata("    L3:0=00f;1=00f\n    MB:0=20;1=20\n"))
    assert not schemata_matches(s, parse_schemata("L3:0=00f;1=7ff\nMB:0=20;1=20\n"))
    assert not schemata_matches(s, parse_schemata("L3:0=00f;1=00f\n"))
    assert not schemata_matches(s, parse_schemata("L3:0=zz;1=00f\nMB:0=20;1=20\n"))


def test_parse_schemata_skips_garbage() -> None:
    assert parse_schemata("garbage\n:x\nL3:0=7ff;x=1;1=7ff\nMB:\n") == {
        "L3": {0: "7ff", 1: "7ff"}, "MB": {}}


@pytest.fixture
def intel(tmp_path: Path) -> Env:
    return Env(intel_tree(tmp_path / "resctrl"))


def fs_of(env: Env) -> ResctrlFs:
    assert env.fs is not None, env.warnings
    return env.fs


# --- detection -------------------------------------------------------------------------------

def test_detect_intel(intel: Env) -> None:
    info = fs_of(intel).info
    assert (info.cbm_mask, info.cbm_bits, info.min_cbm_bits, info.num_closids) == (0x7FF, 11, 1, 16)
    assert (info.l3_ids, info.mb_ids) == ((0, 1), (0, 1))
    assert (info.mb_gran, info.mb_min, info.mb_delay_linear) == (10, 10, True)
    assert (info.mb_absolute, info.mb_max, info.monitoring) == (False, 100, True)
    assert intel.warnings == []


def test_detect_amd(tmp_path: Path) -> None:
    env = Env(amd_tree(tmp_path / "resctrl"))
    info = fs_of(env).info
    assert (info.cbm_mask, info.cbm_bits) == (0xFFFF, 16)
    assert (info.mb_absolute, info.mb_max, info.mb_gran, info.mb_min) == (True, 2048, 1, 0)
    assert info.mb_delay_linear is False
    assert info.monitoring is False


def test_mba_mbps_mount_leaves_mb_alone(tmp_path: Path) -> None:
    info = fs_of(Env(intel_tree(tmp_path / "r", mb_mode="mbps"))).info
    assert info.has_l3
    assert not info.has_mb


def _break(root: Path, how: str) -> None:
    if how == "empty":
        for path in sorted(root.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
    elif how == "missing":
        import shutil
        shutil.rmtree(root)
    elif how == "no_alloc":
        import shutil
        shutil.rmtree(root / "info" / "L3")
        shutil.rmtree(root / "info" / "MB")
    elif how == "bad_mask":
        (root / "info" / "L3" / "cbm_mask").write_text("zz\n")
    elif how == "no_schemata":
        (root / "schemata").unlink()


@pytest.mark.parametrize(("how", "why"), [
    ("empty", "not mounted"), ("missing", "not mounted"), ("no_schemata", "not mounted"),
    ("no_alloc", "neither L3 nor MB"), ("bad_mask", "cannot read"),
])
def test_unusable_resctrl_is_off_with_one_warning(tmp_path: Path, how: str, why: str) -> None:
    root = intel_tree(tmp_path / "resctrl")
    _break(root, how)
    env = Env(root)
    assert env.fs is None
    assert len(env.warnings) == 1
    assert why in env.warnings[0]


def test_read_info_on_missing_root_raises(tmp_path: Path) -> None:
    from reconciler.host.resctrl_files import ResctrlUnavailable
    with pytest.raises(ResctrlUnavailable):
        read_info(SysFs(tmp_path), "/nope", 2048)


# --- groups ----------------------------------------------------------------------------------

def test_ensure_group_writes_only_when_different(intel: Env) -> None:
    fs = fs_of(intel)
    schemata = build_schemata(Allocation(l3=(0, 30), mb=20), fs.info)
    assert fs.ensure_group("nriqos-reclaimed_cores", schemata, reason="config") is True
    path = intel.root / "nriqos-reclaimed_cores" / "schemata"
    assert path.read_text() == "L3:0=f;1=f\nMB:0=20;1=20\n"
    # What the kernel would show: padded masks, aligned names. Same values: no write.
    path.write_text("    L3:0=00f;1=00f\n    MB:0=20;1=20\n")
    before = path.stat().st_mtime_ns
    assert fs.ensure_group("nriqos-reclaimed_cores", schemata, reason="config") is False
    assert path.stat().st_mtime_ns == before
    changed = build_schemata(Allocation(l3=(0, 50), mb=30), fs.info)
    assert fs.ensure_group("nriqos-reclaimed_cores", changed, reason="reload") is True
    assert path.read_text() == "L3:0=3f;1=3f\nMB:0=30;1=30\n"
    records = intel.sink.named("resctrl_group_created")
    assert [(r["group"], r["schemata"], r["reason"]) for r in records] == [
        ("nriqos-reclaimed_cores", ["L3:0=f;1=f", "MB:0=20;1=20"], "config"),
        ("nriqos-reclaimed_cores", ["L3:0=3f;1=3f", "MB:0=30;1=30"], "reload"),
    ]


def test_amd_group_schemata_in_absolute_units(tmp_path: Path) -> None:
    env = Env(amd_tree(tmp_path / "resctrl"))
    fs = fs_of(env)
    fs.ensure_group("nriqos-reclaimed_cores", build_schemata(Allocation(l3=(0, 25), mb=50),
                                                             fs.info), reason="config")
    assert (env.root / "nriqos-reclaimed_cores" / "schemata").read_text() == (
        "L3:0=f;1=f\nMB:0=1024;1=1024\n")


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", "info", "", "mon_groups"])
def test_group_paths_are_validated(intel: Env, name: str) -> None:
    fs = fs_of(intel)
    with pytest.raises(ValueError, match="invalid resctrl group name"):
        fs.ensure_group(name, build_schemata(Allocation(), fs.info), reason="x")
    assert not (intel.root.parent / "escape").exists()


def test_schemata_write_failure_removes_the_new_group(intel: Env) -> None:
    fs = fs_of(intel)
    # A directory where the schemata file should be makes the write fail like EINVAL would.
    bad = build_schemata(Allocation(), fs.info)
    (intel.root / "nriqos-x").mkdir()
    (intel.root / "nriqos-x" / "schemata").mkdir()
    with pytest.raises(GroupError, match="schemata"):
        fs.ensure_group("nriqos-x", bad, reason="x")


def test_pod_group_with_monitor_group_and_removal(intel: Env) -> None:
    fs = fs_of(intel)
    schemata = build_schemata(Allocation(l3=(20, 80), mb=20), fs.info)
    used = fs.create_pod_group("nriqos-pod-u1", schemata, pod_uid="u1",
                               class_groups=CLASS_GROUPS, fallback="nriqos-shared_cores")
    assert used == "nriqos-pod-u1"
    assert (intel.root / "nriqos-pod-u1" / "mon_groups" / "nriqos-pod-u1").is_dir()
    assert fs.has_monitor("nriqos-pod-u1")
    assert fs.our_groups() == ["nriqos-pod-u1"]
    assert fs.remove_group("nriqos-pod-u1", reason="pod removed") is True
    assert not (intel.root / "nriqos-pod-u1").exists()
    assert fs.remove_group("nriqos-pod-u1", reason="again") is False
    assert intel.sink.named("resctrl_group_removed") == [
        {"group": "nriqos-pod-u1", "reason": "pod removed"}]


def test_foreign_groups_count_but_are_not_ours(intel: Env) -> None:
    fs = fs_of(intel)
    (intel.root / "COS1").mkdir()
    (intel.root / "nriqos-shared_cores").mkdir()
    assert fs.control_groups() == ["COS1", "nriqos-shared_cores"]
    assert fs.our_groups() == ["nriqos-shared_cores"]


def test_clos_budget_reserves_class_groups_and_root(tmp_path: Path) -> None:
    # 7 CLOS: root + 4 class groups leave room for exactly 2 pod groups.
    env = Env(intel_tree(tmp_path / "resctrl", num_closids=7))
    fs = fs_of(env)
    full = build_schemata(Allocation(), fs.info)
    got = [fs.create_pod_group(f"nriqos-pod-u{i}", full, pod_uid=f"u{i}",
                               class_groups=CLASS_GROUPS, fallback="nriqos-reclaimed_cores")
           for i in range(4)]
    assert got == ["nriqos-pod-u0", "nriqos-pod-u1", "nriqos-reclaimed_cores",
                   "nriqos-reclaimed_cores"]
    assert not (env.root / "nriqos-pod-u2").exists()
    falls = env.sink.named("resctrl_fallback")
    assert [f["pod_uid"] for f in falls] == ["u2", "u3"]
    assert "CLOS budget exhausted" in falls[0]["reason"]
    # Class groups created later still fit: the budget kept their CLOS.
    for name in CLASS_GROUPS:
        fs.ensure_group(name, full, reason="config")
    assert 1 + len(fs.control_groups()) == 7
    # An existing pod group is reused even with the budget exhausted.
    assert fs.create_pod_group("nriqos-pod-u0", full, pod_uid="u0", class_groups=CLASS_GROUPS,
                               fallback=None) == "nriqos-pod-u0"


# --- observe mode ----------------------------------------------------------------------------

UNLIMITED_REASON = "observe mode: no limit (the kernel's default)"


class Observed:
    """A resctrl tree whose writes are held back while ``observing[0]``."""

    def __init__(self, root: Path) -> None:
        self.sink = MemoryAuditSink()
        self.root = root
        self.observing = [False]
        audit = AuditLog(self.sink)
        sysfs = SysFs(root, audit).observing(lambda: self.observing[0])
        self.fs = ResctrlFs(sysfs, "/", read_info(sysfs, "/", 2048), prefix="nriqos-",
                            audit=audit)

    def schemata(self, group: str) -> str:
        return (self.root / group / "schemata").read_text()


def test_observe_mode_gives_a_limited_group_back_the_kernels_default(tmp_path: Path) -> None:
    env = Observed(intel_tree(tmp_path / "resctrl"))
    limited = build_schemata(Allocation(l3=(0, 30), mb=20), env.fs.info)
    env.fs.ensure_group("nriqos-reclaimed_cores", limited, reason="config")
    assert env.schemata("nriqos-reclaimed_cores") == "L3:0=f;1=f\nMB:0=20;1=20\n"
    env.observing[0] = True
    assert env.fs.ensure_group("nriqos-reclaimed_cores", limited, reason="config") is True
    assert env.schemata("nriqos-reclaimed_cores") == "L3:0=7ff;1=7ff\nMB:0=100;1=100\n"
    # From then on the limit is only decided: audited once as held back, never written.
    for _ in range(3):
        assert env.fs.ensure_group("nriqos-reclaimed_cores", limited, reason="config") is False
    assert env.schemata("nriqos-reclaimed_cores") == "L3:0=7ff;1=7ff\nMB:0=100;1=100\n"
    assert [(r["path"], r["value"]) for r in env.sink.named("write_observed")] == [
        ("/nriqos-reclaimed_cores/schemata", "L3:0=f;1=f\\nMB:0=20;1=20")]
    assert [(r["schemata"], r["reason"], r["created"])
            for r in env.sink.named("resctrl_group_created")] == [
        (["L3:0=f;1=f", "MB:0=20;1=20"], "config", True),
        (["L3:0=7ff;1=7ff", "MB:0=100;1=100"], UNLIMITED_REASON, False)]
    # A group made in observe mode keeps the default the kernel gives it: nothing is written.
    assert env.fs.ensure_group("nriqos-shared_cores", limited, reason="config") is True
    assert not (env.root / "nriqos-shared_cores" / "schemata").exists()
    # Back in enforce mode the limit is written again.
    env.observing[0] = False
    assert env.fs.ensure_group("nriqos-reclaimed_cores", limited, reason="config") is True
    assert env.schemata("nriqos-reclaimed_cores") == "L3:0=f;1=f\nMB:0=20;1=20\n"


def test_lift_limits_writes_the_whole_cache_and_bandwidth_once(tmp_path: Path) -> None:
    env = Observed(amd_tree(tmp_path / "resctrl"))
    group = "nriqos-pod-u1"
    env.fs.create_pod_group(group, build_schemata(Allocation(l3=(0, 25), mb=50), env.fs.info),
                            pod_uid="u1", class_groups=CLASS_GROUPS, fallback=None)
    assert env.schemata(group) == "L3:0=f;1=f\nMB:0=1024;1=1024\n"
    env.observing[0] = True
    assert env.fs.lift_limits(group) is True
    assert env.schemata(group) == "L3:0=ffff;1=ffff\nMB:0=2048;1=2048\n"
    assert env.fs.lift_limits(group) is False
    # The kernel's padding is no limit; a value that does not parse is taken for one.
    (env.root / group / "schemata").write_text("    L3:0=0ffff;1=ffff\n    MB:0=2048;1=2048\n")
    assert env.fs.lift_limits(group) is False
    (env.root / group / "schemata").write_text("L3:0=ffff;1=zz\nMB:0=2048;1=2048\n")
    assert env.fs.lift_limits(group) is True
    assert env.schemata(group) == "L3:0=ffff;1=ffff\nMB:0=2048;1=2048\n"
    assert [r["reason"] for r in env.sink.named("resctrl_group_created")] == [
        "pod u1", UNLIMITED_REASON, UNLIMITED_REASON]


def test_remove_our_groups_leaves_foreign_ones(intel: Env) -> None:
    fs = fs_of(intel)
    full = build_schemata(Allocation(), fs.info)
    for name in (*CLASS_GROUPS, "nriqos-pod-u1"):
        fs.ensure_group(name, full, reason="config")
    (intel.root / "COS1").mkdir()
    assert fs.remove_our_groups(reason="resctrl.enabled is false") == {}
    assert fs.control_groups() == ["COS1"]
    assert sorted((r["group"], r["reason"]) for r in intel.sink.named("resctrl_group_removed")) == [
        (name, "resctrl.enabled is false") for name in sorted((*CLASS_GROUPS, "nriqos-pod-u1"))]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs that runs out of inodes: mkdir fails with ENOSPC, as resctrl does without CLOS."""
    with tmpfs(tmp_path / "mnt", "size=1m,nr_inodes=200") as mnt:
        yield mnt


def test_enospc_from_mkdir_falls_back(tiny_tmpfs: Path) -> None:
    env = Env(intel_tree(tiny_tmpfs))
    fs = fs_of(env)
    st = os.statvfs(tiny_tmpfs)
    used = st.f_files - st.f_ffree
    subprocess.run(["mount", "-o", f"remount,nr_inodes={used}", str(tiny_tmpfs)], check=True)
    got = fs.create_pod_group("nriqos-pod-u1", build_schemata(Allocation(), fs.info),
                              pod_uid="u1", class_groups=[], fallback="nriqos-shared_cores")
    assert got == "nriqos-shared_cores"
    assert "ENOSPC" in env.sink.named("resctrl_fallback")[0]["reason"]


# --- tasks -----------------------------------------------------------------------------------

def tasks_in(fs: ResctrlFs, group: str, *, monitor: bool = False) -> set[int]:
    return {int(tid) for tid in (fs.sysfs.read_bytes(fs.tasks_file(group, monitor=monitor))
                                 or b"").split()}


def test_add_and_read_tasks(intel: Env) -> None:
    fs = fs_of(intel)
    fs.create_pod_group("nriqos-pod-u1", build_schemata(Allocation(), fs.info), pod_uid="u1",
                        class_groups=[], fallback=None)
    assert fs.add_tasks("nriqos-pod-u1", [101, 102, 0, -4, 103]) == 3
    assert tasks_in(fs, "nriqos-pod-u1") == {101, 102, 103}
    assert fs.add_tasks("nriqos-pod-u1", [101], monitor=True) == 1
    assert tasks_in(fs, "nriqos-pod-u1", monitor=True) == {101}
    assert fs.add_tasks("nriqos-pod-u1", []) == 0
    # One id per write: the file holds one line per id.
    assert (intel.root / "nriqos-pod-u1" / "tasks").read_text() == "101\n102\n103\n"
    assert intel.sink.named("tasks_moved") == [
        {"group": "nriqos-pod-u1", "count": 3, "monitor": False},
        {"group": "nriqos-pod-u1", "count": 1, "monitor": True},
    ]


def test_add_tasks_to_missing_group_raises(intel: Env) -> None:
    with pytest.raises(FileNotFoundError):
        fs_of(intel).add_tasks("nriqos-gone", [1])


@pytest.fixture
def real_tasks_file(tmp_path: Path) -> Iterator[Path]:
    """A real kernel ``tasks`` file (a cgroup v1 pids group): it answers ESRCH for dead ids,
    as resctrl's does."""
    base = Path("/sys/fs/cgroup/pids")
    probe = base / f"nriqos-test-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError:
        pytest.skip("no writable cgroup v1 pids hierarchy")
    try:
        yield probe
    finally:
        for _ in range(50):
            try:
                probe.rmdir()
                break
            except OSError:
                subprocess.run(["sleep", "0.05"], check=False)


def test_add_tasks_skips_exited_tasks(tmp_path: Path, real_tasks_file: Path) -> None:
    root = intel_tree(tmp_path / "resctrl")
    (root / "nriqos-pod-u1").symlink_to(real_tasks_file)
    env = Env(root)
    fs = fs_of(env)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = subprocess.Popen(["sleep", "30"])
    try:
        assert fs.add_tasks("nriqos-pod-u1", [gone.pid, alive.pid]) == 1
        assert alive.pid in tasks_in(fs, "nriqos-pod-u1")
    finally:
        alive.kill()
        alive.wait()
