"""Every effect is undone: the memory guard's cap and squeeze when the guard goes away (a reload,
the agent stopping, a restart that finds it off), memory.wmark_ratio and taints across restarts,
through the state file that survives them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.agent import build_agent
from nri_plugin.config.schema import Config
from nri_plugin.config.store import ConfigStore
from nri_plugin.session.stub import PluginIdentity
from reconciler.detection.pods import PodIndex
from reconciler.detection.signals import Level
from reconciler.host import statefile
from reconciler.host.cgroups import layout_for
from reconciler.host.probe import probe_host
from reconciler.host.statefile import StateFile, state_file
from reconciler.host.sysfs import SysFs
from reconciler.loops.base import Loop
from reconciler.loops.memory_guard import NOTES, MemoryGuardLoop
from reconciler.loops.memory_squeeze import GuardSqueeze, Squeeze
from reconciler.loops.numa_binding import NUMA_NOTES, NumaBindingLoop
from reconciler.mitigation.actions import WMARK_NOTES, Cause, TuneAction
from reconciler.runner import run_reconciler
from tests.support.fakesys import GIB, MIB, UNLIMITED_V1, FakeHost, FakePod
from tests.support.guard_config import standing

# -- the state file -------------------------------------------------------------------------------


def test_notes_survive_a_new_instance_and_the_first_value_is_kept(tmp_path: Path) -> None:
    notes = state_file(str(tmp_path / "state"))
    assert notes.remember("s", "/a", "max")
    assert notes.remember("s", "/a", "12345")  # already noted: the first value stays
    notes.put("t", "key", "NoSchedule")
    again = state_file(str(tmp_path / "state"))
    assert again.entries("s") == {"/a": "max"}
    assert again.entries("t") == {"key": "NoSchedule"}
    again.forget("s", "/a")
    assert state_file(str(tmp_path / "state")).entries("s") == {}
    assert os.stat(tmp_path / "state").st_mode & 0o777 == 0o700
    assert os.stat(tmp_path / "state" / "state.json").st_mode & 0o777 == 0o600


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", b"[" * 10_000,
                                     b" " * (statefile.MAX_FILE_BYTES + 1)])
def test_an_unusable_file_is_set_aside_and_the_agent_starts_from_nothing(
        tmp_path: Path, content: bytes) -> None:
    (tmp_path / "state.json").write_bytes(content)
    notes = state_file(str(tmp_path))
    assert notes.entries("memory_guard") == {}
    assert (tmp_path / "state.json.bad").read_bytes() == content
    assert notes.remember("memory_guard", "/a", "max")
    assert json.loads((tmp_path / "state.json").read_text()) == {"memory_guard": {"/a": "max"}}


def test_values_that_are_not_strings_are_dropped(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text(json.dumps(
        {"memory_guard": {"/a": "max", "/b": 5}, "odd": [1], "taint": {"k": "NoSchedule"}}))
    notes = state_file(str(tmp_path))
    assert notes.entries("memory_guard") == {"/a": "max"}
    assert notes.entries("taint") == {"k": "NoSchedule"}


def test_notes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statefile, "MAX_ENTRIES", 2)
    notes = StateFile(None)
    assert notes.remember("s", "/a", "1")
    assert notes.remember("t", "/b", "2")
    assert not notes.remember("s", "/c", "3")
    assert notes.entries("s") == {"/a": "1"}


def test_a_directory_that_cannot_be_written_keeps_the_notes_in_memory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    notes = state_file(str(tmp_path / "file"))  # a file where the directory should be
    assert notes.remember("s", "/a", "max")
    assert notes.entries("s") == {"/a": "max"}


# -- the memory guard -----------------------------------------------------------------------------

def guard(tmp_path: Path, version: int, notes: StateFile,
          squeeze: GuardSqueeze | None = None) -> tuple[FakeHost, MemoryGuardLoop, list[Config]]:
    host = FakeHost(tmp_path / "host", version=version,
                    driver="systemd" if version == 2 else "cgroupfs")
    host.set_numa([(8 * GIB, 32 * GIB, 0)])
    host.set_tier_usage("besteffort", 2 * GIB, per_node=[2 * GIB])
    cfg = [standing()]
    audit = AuditLog(MemoryAuditSink())
    sysfs = SysFs(host.root, audit)
    loop = MemoryGuardLoop(lambda: cfg[0], sysfs, layout_for(sysfs), audit, squeeze,
                           notes=notes)
    return host, loop, cfg


def tier_files(host: FakeHost) -> dict[str, str]:
    d = host.tier_dir("besteffort")
    names = ("memory.max", "memory.high") if host.version == 2 else ("memory.limit_in_bytes",)
    return {name: (d / name).read_text().strip() for name in names}


ORIGINAL = {2: {"memory.max": "max", "memory.high": "max"},
            1: {"memory.limit_in_bytes": UNLIMITED_V1}}


def guard_off(cfg: list[Config]) -> None:
    cfg[0] = dataclasses.replace(cfg[0], memory_guard=dataclasses.replace(
        cfg[0].memory_guard, enabled=False))


@pytest.mark.parametrize("version", [1, 2])
def test_a_guard_switched_off_by_a_reload_restores_the_tier(tmp_path: Path,
                                                            version: int) -> None:
    notes = StateFile(None)
    host, loop, cfg = guard(tmp_path, version, notes)
    loop.cycle(0.0)
    assert tier_files(host) != ORIGINAL[version]
    guard_off(cfg)
    loop.cycle(1.0)
    assert tier_files(host) == ORIGINAL[version]
    assert notes.entries(NOTES) == {}


@pytest.mark.parametrize("reconciler_off", [False, True])
def test_a_squeezed_tier_is_restored_when_the_guard_goes(tmp_path: Path,
                                                         reconciler_off: bool) -> None:
    squeeze = GuardSqueeze()
    host, loop, cfg = guard(tmp_path, 2, StateFile(None), squeeze)
    squeeze.set(Squeeze(64 * MIB, 256 * MIB, "test"))
    loop.cycle(0.0)
    assert tier_files(host)["memory.high"] != "max"
    if reconciler_off:
        cfg[0] = dataclasses.replace(cfg[0], reconciler=dataclasses.replace(
            cfg[0].reconciler, enabled=False))
    else:
        guard_off(cfg)
    loop.cycle(1.0)
    assert tier_files(host) == ORIGINAL[2]


@pytest.mark.parametrize("version", [1, 2])
def test_the_agent_stopping_restores_the_tier(tmp_path: Path, version: int) -> None:
    host, loop, _ = guard(tmp_path, version, StateFile(None))
    loop.cycle(0.0)
    loop.close()
    assert tier_files(host) == ORIGINAL[version]
    loop.close()  # again: nothing left to do
    assert tier_files(host) == ORIGINAL[version]


def test_a_restart_restores_what_the_tier_had_before_the_first_run(tmp_path: Path) -> None:
    path = str(tmp_path / "state")
    host, first, _ = guard(tmp_path, 2, state_file(path))
    first.cycle(0.0)
    capped = tier_files(host)
    # The agent dies without restoring (a crash): the next run finds the cap in place.
    audit = AuditLog(MemoryAuditSink())
    sysfs = SysFs(host.root, audit)
    cfg = [Config()]
    guard_off(cfg)
    notes = state_file(path)
    assert set(notes.entries(NOTES)) == {
        f"/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice/{name}" for name in capped}
    second = MemoryGuardLoop(lambda: cfg[0], sysfs, layout_for(sysfs), audit, notes=notes)
    second.cycle(0.0)
    assert tier_files(host) == ORIGINAL[2]
    assert state_file(path).entries(NOTES) == {}


def test_a_restart_with_the_guard_on_keeps_the_value_from_before_the_first_run(
        tmp_path: Path) -> None:
    path = str(tmp_path / "state")
    host, first, _ = guard(tmp_path, 1, state_file(path))
    first.cycle(0.0)
    audit = AuditLog(MemoryAuditSink())
    sysfs = SysFs(host.root, audit)
    second = MemoryGuardLoop(Config, sysfs, layout_for(sysfs), audit, notes=state_file(path))
    host.set_tier_usage("besteffort", 3 * GIB, per_node=[3 * GIB])
    second.cycle(0.0)
    second.close()
    assert tier_files(host) == ORIGINAL[1]


class Closing(Loop):
    name = "closing"

    def __init__(self) -> None:
        self.cycles = 0
        self.closed_after = -1

    def interval(self) -> float:
        return 0.05

    def cycle(self, now: float) -> None:
        self.cycles += 1

    def close(self) -> None:
        self.closed_after = self.cycles


class Failing(Closing):
    name = "failing"

    def close(self) -> None:
        raise RuntimeError("cannot undo")


async def test_the_reconciler_closes_every_loop_when_it_stops() -> None:
    loops: list[Loop] = [Failing(), Closing()]
    stop = asyncio.Event()
    task = asyncio.create_task(run_reconciler(loops, NodeState(), stop, None,
                                              read_keys=lambda: Config().read_keys(),
                                              backoff_max=lambda: 1.0))
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(task, 5)
    closing = loops[1]
    assert isinstance(closing, Closing)
    assert closing.cycles > 0
    assert closing.closed_after == closing.cycles


# -- memory.wmark_ratio ---------------------------------------------------------------------------

def tune(host: FakeHost, notes: StateFile) -> TuneAction:
    sysfs = SysFs(host.root, AuditLog(MemoryAuditSink()))
    state = NodeState()
    state.replace_all(*host.nri())
    info = probe_host(sysfs)
    return TuneAction(Config, GuardSqueeze(), sysfs, info, PodIndex(state, info.cgroup),
                      lambda: True, notes)


async def test_a_restart_still_restores_wmark_ratio(tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host", version=2, driver="systemd")
    (host.tier_dir("guaranteed") / "memory.wmark_ratio").write_text("0\n")
    uid = "batch-0000-4000-8000-000000000000"
    host.add_pod(uid, tier="besteffort", name="batch",
                 annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
    wmark = host.cg("memory", host.pod_rel("besteffort", uid)) / "memory.wmark_ratio"
    wmark.write_text("95\n")
    path = str(tmp_path / "state")
    await tune(host, state_file(path)).engage(Cause(Level.LOW), dry_run=False)
    assert wmark.read_text() == "80"
    # A new run (the ladder releases every rung at start) restores what the first one saved.
    result = await tune(host, state_file(path)).release(Cause(Level.NONE), dry_run=False)
    assert result.result == "done"
    assert wmark.read_text() == "95"
    assert state_file(path).entries(WMARK_NOTES) == {}


# -- NUMA binding ---------------------------------------------------------------------------------

def numa(tmp_path: Path, notes: StateFile) -> tuple[FakeHost, NumaBindingLoop, list[Config],
                                                    FakePod]:
    host = FakeHost(tmp_path / "host", version=2, driver="systemd")
    offline = host.add_pod("11111111-0000-0000-0000-000000000001", tier="besteffort")
    host.set_numa([(20 * GIB, 64 * GIB, 1000), (2 * GIB, 64 * GIB, 1000)])
    state = NodeState()
    state.replace_all(*host.nri())
    cfg = [Config()]
    sysfs = SysFs(host.root, AuditLog(MemoryAuditSink()))
    loop = NumaBindingLoop(lambda: cfg[0], state, sysfs, layout_for(sysfs),
                           AuditLog(MemoryAuditSink()), notes=notes)
    return host, loop, cfg, offline


def bound(host: FakeHost, pod: FakePod) -> str:
    return (host.cg("cpuset", pod.containers[0].rel) / "cpuset.mems").read_text().strip()


def test_a_binding_switched_off_by_a_reload_is_undone(tmp_path: Path) -> None:
    notes = StateFile(None)
    host, loop, cfg, offline = numa(tmp_path, notes)
    loop.cycle(0.0)
    assert bound(host, offline) == "0"
    assert list(notes.entries(NUMA_NOTES).values()) == [""]
    cfg[0] = dataclasses.replace(cfg[0], numa=dataclasses.replace(cfg[0].numa, enabled=False))
    loop.cycle(1.0)
    assert bound(host, offline) == ""
    assert notes.entries(NUMA_NOTES) == {}


def test_notes_of_containers_that_are_gone_are_dropped(tmp_path: Path) -> None:
    notes = StateFile(None)
    host, loop, _, offline = numa(tmp_path, notes)
    loop.cycle(0.0)
    assert len(notes.entries(NUMA_NOTES)) == 1
    shutil.rmtree(host.cg("cpuset", offline.containers[0].rel))
    loop.cycle(1.0)
    assert notes.entries(NUMA_NOTES) == {}


async def test_an_agent_started_with_the_reconciler_off_restores_what_an_earlier_run_left(
        tmp_path: Path) -> None:
    state_dir = str(tmp_path / "state")
    host, first, _ = guard(tmp_path, 2, state_file(state_dir))
    first.cycle(0.0)  # an earlier run capped the tier, then died
    assert tier_files(host) != ORIGINAL[2]
    cfg = Config()
    cfg = dataclasses.replace(
        cfg, status=dataclasses.replace(cfg.status, enabled=False),
        reconciler=dataclasses.replace(cfg.reconciler, enabled=False, root=str(host.root),
                                       state_dir=state_dir),
        kubernetes=dataclasses.replace(cfg.kubernetes, enabled=False))
    audit = AuditLog(MemoryAuditSink())
    sysfs = SysFs(host.root, audit)
    agent = build_agent(ConfigStore(audit, config=cfg), audit, probe_host(sysfs), sysfs,
                        PluginIdentity("nri-qos", "10"), run_background=True)
    try:
        (leftovers,) = agent.services[1:]
        await leftovers(asyncio.Event())
    finally:
        agent.executor.shutdown()
    assert tier_files(host) == ORIGINAL[2]
    assert state_file(state_dir).entries(NOTES) == {}


# -- a node switched from enforce to observe ------------------------------------------------------

@pytest.mark.parametrize("version", [1, 2])
def test_switching_to_observe_gives_the_tier_back_and_holds_later_caps(tmp_path: Path,
                                                                         version: int) -> None:
    observing = [False]
    host = FakeHost(tmp_path / "host", version=version,
                    driver="systemd" if version == 2 else "cgroupfs")
    host.set_numa([(8 * GIB, 32 * GIB, 0)])
    host.set_tier_usage("besteffort", 2 * GIB, per_node=[2 * GIB])
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(host.root, audit).observing(lambda: observing[0])
    loop = MemoryGuardLoop(standing, sysfs, layout_for(sysfs), audit, notes=StateFile(None))
    loop.cycle(0.0)
    capped = tier_files(host)
    assert capped != ORIGINAL[version]
    observing[0] = True
    loop.cycle(1.0)
    assert tier_files(host) == ORIGINAL[version]
    # still deciding: the cap it would write is audited, not written
    assert sink.named("write_observed")
    loop.cycle(2.0)
    assert tier_files(host) == ORIGINAL[version]
    observing[0] = False  # enforcing again: the cap comes back
    loop.cycle(3.0)
    assert tier_files(host) == capped


def test_switching_to_observe_undoes_the_bindings(tmp_path: Path) -> None:
    observing = [False]
    host = FakeHost(tmp_path / "host", version=2, driver="systemd")
    offline = host.add_pod("11111111-0000-0000-0000-000000000001", tier="besteffort")
    host.set_numa([(20 * GIB, 64 * GIB, 1000), (2 * GIB, 64 * GIB, 1000)])
    state = NodeState()
    state.replace_all(*host.nri())
    sysfs = SysFs(host.root, AuditLog(MemoryAuditSink())).observing(lambda: observing[0])
    loop = NumaBindingLoop(Config, state, sysfs, layout_for(sysfs), AuditLog(MemoryAuditSink()),
                           notes=StateFile(None))
    before = bound(host, offline)
    loop.cycle(0.0)
    assert bound(host, offline) == "0"
    observing[0] = True
    loop.cycle(1.0)
    assert bound(host, offline) == before
