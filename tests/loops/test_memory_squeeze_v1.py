"""A cgroup v1 squeeze holds the tier's OOM killer off: ``oom_kill_disable`` goes to 1 before the
squeezed limit is written and back to what it was after the limit is raised, the guard looks
again every second while it holds the tier so, and a tier whose killer cannot be turned off is
not squeezed. The kernel's side (a growing job waits at the limit instead of dying) is
``tests/host/test_squeeze_kernel.py``."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_guard import NOTES, MemoryGuardLoop, restore_tier
from reconciler.loops.memory_squeeze import (
    OOM_CONTROL,
    PAUSED_RECHECK_S,
    GuardSqueeze,
    Squeeze,
    kill_disabled,
    same_kill_setting,
)
from tests.support.fakesys import GIB, MIB, FakeHost
from tests.support.refusals import refuse_writes

SQUEEZE = Squeeze(64 * MIB, 256 * MIB, "refaults of online pods")
KERNEL_TEXT = "oom_kill_disable {}\nunder_oom 0\noom_kill 0\n"


class KillerKept(SysFs):
    """The kernel refusing every write to the OOM killer's file (as a kernel that no longer
    lets v1 turn it off would)."""

    @staticmethod
    def _write_once(real: str, data: bytes, create: bool) -> None:
        if real.endswith(OOM_CONTROL):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        SysFs._write_once(real, data, create)


class Guard:
    """The guard on a fake v1 node whose tier uses 2 GiB, ``standing_cap`` as given."""

    def __init__(self, tmp_path: Path, standing_cap: str = "cgroup-v1", version: int = 1,
                 sysfs: type[SysFs] = SysFs) -> None:
        self.host = FakeHost(tmp_path, version=version,
                             driver="systemd" if version == 2 else "cgroupfs")
        self.host.set_numa([(8 * GIB, 32 * GIB, 0)])
        self.host.set_tier_usage("besteffort", 2 * GIB, per_node=[2 * GIB])
        base = Config()
        self.cfg = dataclasses.replace(base, memory_guard=dataclasses.replace(
            base.memory_guard, standing_cap=standing_cap, watermark_floor_percent=100.0))
        self.sink = MemoryAuditSink()
        audit = AuditLog(self.sink)
        self.sysfs = sysfs(tmp_path, audit)
        self.squeeze = GuardSqueeze()
        self.notes = StateFile(None)
        self.loop = MemoryGuardLoop(lambda: self.cfg, self.sysfs, layout_for(self.sysfs), audit,
                                    self.squeeze, notes=self.notes)
        self.tier = self.host.tier_dir("besteffort")

    def killer(self) -> str | None:
        return kill_disabled((self.tier / OOM_CONTROL).read_text())

    def limit(self) -> str:
        return (self.tier / "memory.limit_in_bytes").read_text().strip()

    def writes(self) -> list[str]:
        """The names of the files written, in order."""
        return [Path(r["path"]).name for r in self.sink.named("cgroup_write")]


def test_the_killer_goes_off_before_the_squeezed_limit_and_back_after_it_is_raised(
        tmp_path: Path) -> None:
    guard = Guard(tmp_path)
    guard.loop.cycle(0.0)
    capped = guard.limit()
    assert guard.killer() == "0"
    assert guard.loop.interval() == 5.0
    guard.squeeze.set(SQUEEZE)
    guard.loop.cycle(1.0)
    assert guard.limit() == str(2 * GIB - 64 * MIB)
    assert guard.killer() == "1"
    assert guard.writes()[-2:] == [OOM_CONTROL, "memory.limit_in_bytes"]
    assert guard.notes.entries(NOTES)[str(guard.tier / OOM_CONTROL).removeprefix(
        str(tmp_path))] == "0"
    assert guard.loop.interval() == PAUSED_RECHECK_S
    guard.loop.cycle(2.0)  # held: nothing written again
    assert guard.writes()[-1] == "memory.limit_in_bytes"
    assert len(guard.writes()) == 3
    guard.squeeze.set(None)
    guard.loop.cycle(3.0)
    assert guard.limit() == capped
    assert guard.killer() == "0"
    assert guard.writes()[-2:] == ["memory.limit_in_bytes", OOM_CONTROL]
    assert all(not p.endswith(OOM_CONTROL) for p in guard.notes.entries(NOTES))
    assert guard.loop.interval() == 5.0


def test_a_killer_someone_had_turned_off_stays_off_after_the_squeeze(tmp_path: Path) -> None:
    guard = Guard(tmp_path)
    (guard.tier / OOM_CONTROL).write_text(KERNEL_TEXT.format(1))
    guard.squeeze.set(SQUEEZE)
    guard.loop.cycle(0.0)
    assert OOM_CONTROL not in guard.writes()  # already off: nothing to write
    guard.squeeze.set(None)
    guard.loop.cycle(1.0)
    assert guard.killer() == "1"
    assert OOM_CONTROL not in guard.writes()


@pytest.mark.parametrize("standing_cap", ["cgroup-v1", "never"])
def test_the_agent_stopping_while_squeezed_raises_the_limit_before_the_killer_is_back(
        tmp_path: Path, standing_cap: str) -> None:
    guard = Guard(tmp_path, standing_cap)
    guard.squeeze.set(SQUEEZE)
    guard.loop.cycle(0.0)
    before = len(guard.writes())
    guard.loop.close()
    assert guard.writes()[before:] == ["memory.limit_in_bytes", OOM_CONTROL]
    assert guard.killer() == "0"
    assert guard.notes.entries(NOTES) == {}
    assert guard.loop.interval() == 5.0


def test_restore_writes_the_limit_first_whatever_the_order_of_the_notes(tmp_path: Path) -> None:
    guard = Guard(tmp_path)
    (guard.tier / OOM_CONTROL).write_text(KERNEL_TEXT.format(1))
    (guard.tier / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    rel = "/" + str(guard.tier.relative_to(tmp_path))
    guard.notes.remember(NOTES, f"{rel}/{OOM_CONTROL}", "0")  # noted first
    guard.notes.remember(NOTES, f"{rel}/memory.limit_in_bytes", str(4 * GIB))
    restored = restore_tier(guard.sysfs, guard.notes, "test")
    assert [Path(p).name for p, _ in restored] == ["memory.limit_in_bytes", OOM_CONTROL]
    assert guard.writes() == ["memory.limit_in_bytes", OOM_CONTROL]
    assert guard.killer() == "0"


def test_a_tier_whose_killer_cannot_be_turned_off_is_not_squeezed(tmp_path: Path) -> None:
    guard = Guard(tmp_path, sysfs=KillerKept)
    guard.loop.cycle(0.0)
    capped = guard.limit()
    guard.squeeze.set(SQUEEZE)
    with capture_logs() as logs:
        guard.loop.cycle(1.0)
        guard.loop.cycle(2.0)
    assert guard.limit() == capped
    skipped = [e for e in logs if e["event"] == "memory_guard_squeeze_skipped"]
    assert len(skipped) == 1  # once, not every cycle
    assert skipped[0]["reason"] == f"writing {OOM_CONTROL}: failed"
    assert guard.loop.interval() == 5.0
    [record] = guard.sink.named("memory_guard_cap")  # the standing cap alone
    assert record["squeezed"] is False


def test_a_tier_without_the_file_is_not_squeezed(tmp_path: Path) -> None:
    guard = Guard(tmp_path, "never")
    (guard.tier / OOM_CONTROL).unlink()
    guard.squeeze.set(SQUEEZE)
    with capture_logs() as logs:
        guard.loop.cycle(0.0)
    assert guard.writes() == []
    assert [e["reason"] for e in logs if e["event"] == "memory_guard_squeeze_skipped"] == [
        f"no {OOM_CONTROL} to read"]


def test_cgroup_v2_has_no_killer_to_hold(tmp_path: Path) -> None:
    guard = Guard(tmp_path, "never", version=2)
    guard.squeeze.set(SQUEEZE)
    guard.loop.cycle(0.0)
    assert guard.writes() == ["memory.high"]
    assert guard.loop.interval() == 5.0


@pytest.mark.parametrize(("text", "value"), [
    (KERNEL_TEXT.format(0), "0"), (KERNEL_TEXT.format(1), "1"), ("1\n", "1"), ("0", "0"),
    ("", None), ("under_oom 1\n", None), ("2\n", None)])
def test_the_kill_setting_is_read_as_the_kernel_shows_it_or_as_written(
        text: str, value: str | None) -> None:
    assert kill_disabled(text) == value
    assert same_kill_setting(text, "1") is (value == "1")


def refuse_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel refusing every write to the tier's limit (as v1 does for a limit above the
    tier's ``memory.memsw.limit_in_bytes``), through every view of the tree."""
    refuse_writes(monkeypatch, errno.EINVAL,
                  lambda real, _: real.endswith("memory.limit_in_bytes"))


@pytest.mark.parametrize("standing_cap", ["cgroup-v1", "never"])
def test_a_limit_that_cannot_be_raised_keeps_the_killer_off(
        tmp_path: Path, standing_cap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    guard = Guard(tmp_path, standing_cap)
    guard.squeeze.set(SQUEEZE)
    guard.loop.cycle(0.0)
    squeezed = guard.limit()
    assert guard.killer() == "1"
    with monkeypatch.context() as refusing:
        refuse_limits(refusing)
        guard.squeeze.set(None)
        guard.loop.cycle(1.0)
        guard.loop.close()
        # A task waiting at the squeezed limit must not be OOM-killed for a limit not raised.
        assert guard.limit() == squeezed
        assert guard.killer() == "1"
        assert any(p.endswith(OOM_CONTROL) for p in guard.notes.entries(NOTES))
    guard.loop.close()
    assert guard.limit() != squeezed
    assert guard.killer() == "0"
    assert guard.notes.entries(NOTES) == {}
