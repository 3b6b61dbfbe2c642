"""The pod, tier and kubepods cgroups above protected containers get the sum of their protection
(cgroup v2), only ever raised, and what was there before comes back when the cause goes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.config_fields import frozen_map
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import CgroupRef, layout_for, parse_cgroups_path
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.loops.drift import DriftLoop
from reconciler.loops.protection import (
    PROTECTION_NOTES,
    WRITTEN_NOTES,
    AncestorProtection,
    ancestor_sums,
    ancestors,
    restore_protection,
)
from tests.support.fakesys import GIB, MIB, FakeHost

ONLINE = "44444444-0000-0000-0000-000000000001"
OTHER = "44444444-0000-0000-0000-000000000002"
SOLID = "44444444-0000-0000-0000-000000000003"
OFFLINE = "44444444-0000-0000-0000-000000000004"


def protecting(min_ratio: int, low_ratio: int) -> Config:
    """The defaults, with shared_cores and dedicated_cores protecting their requests."""
    memory = Config().memory
    levels = dict(memory.levels)
    for level in ("shared_cores", "dedicated_cores"):
        levels[level] = dataclasses.replace(levels[level], policy="ratios",
                                            min_ratio=min_ratio, low_ratio=low_ratio)
    return dataclasses.replace(Config(), memory=dataclasses.replace(
        memory, levels=frozen_map(levels)))


def test_the_ancestors_in_both_drivers() -> None:
    burstable = parse_cgroups_path(f"/kubepods/burstable/pod{ONLINE}/abc")
    assert ancestors(burstable) == [f"kubepods/burstable/pod{ONLINE}", "kubepods/burstable",
                                    "kubepods"]
    assert ancestors(parse_cgroups_path(f"/kubepods/pod{SOLID}/abc")) == [
        f"kubepods/pod{SOLID}", "kubepods"]
    systemd = parse_cgroups_path("kubepods-burstable-pod4444_1.slice:cri-containerd:abc")
    assert ancestors(systemd) == [
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod4444_1.slice",
        "kubepods.slice/kubepods-burstable.slice", "kubepods.slice"]
    # outside kubelet's layout nothing above is touched
    assert ancestors(parse_cgroups_path("/system.slice/daemon/abc")) == []


def test_each_ancestor_gets_the_sum_below_it() -> None:
    def ref(path: str) -> CgroupRef:
        return parse_cgroups_path(path)

    sums = ancestor_sums([
        (ref(f"/kubepods/burstable/pod{ONLINE}/a"), {"memory.min": 100, "memory.low": 10}),
        (ref(f"/kubepods/burstable/pod{ONLINE}/b"), {"memory.min": 20}),
        (ref(f"/kubepods/burstable/pod{OTHER}/c"), {"memory.low": 5}),
        (ref(f"/kubepods/pod{SOLID}/d"), {"memory.min": 1000}),
        (ref(f"/kubepods/besteffort/pod{OFFLINE}/e"), {}),
        (ref("/system.slice/x/f"), {"memory.min": 7}),
    ])
    assert sums == {
        f"kubepods/burstable/pod{ONLINE}": {"memory.min": 120, "memory.low": 10},
        f"kubepods/burstable/pod{OTHER}": {"memory.min": 0, "memory.low": 5},
        "kubepods/burstable": {"memory.min": 120, "memory.low": 15},
        f"kubepods/pod{SOLID}": {"memory.min": 1000, "memory.low": 0},
        "kubepods": {"memory.min": 1120, "memory.low": 15},
    }  # the BestEffort pod and tier protect nothing: left out


class Tree:
    """A v2 fake host with its protection writer and state file."""

    def __init__(self, tmp_path: Path) -> None:
        self.host = FakeHost(tmp_path, version=2)
        self.sink = MemoryAuditSink()
        self.sysfs = SysFs(tmp_path, AuditLog(self.sink))
        self.notes = StateFile(str(tmp_path / "state.json"))
        self.protection = AncestorProtection(self.sysfs, layout_for(self.sysfs), self.notes)

    def file(self, rel: str, key: str = "memory.min") -> Path:
        return self.host.cg("", rel) / key

    @staticmethod
    def noted(rel: str, key: str = "memory.min") -> str:
        """The file as the state file and the audit trail name it."""
        return f"/sys/fs/cgroup/{rel}/{key}"

    def value(self, rel: str, key: str = "memory.min") -> int:
        return int(self.file(rel, key).read_text())

    def apply(self, sums: dict[str, dict[str, int]]) -> None:
        self.protection.apply(sums, "test")

    def restarted(self) -> tuple[AncestorProtection, StateFile]:
        """A new run's protection writer, on the state file as the last run left it."""
        notes = StateFile(self.notes.path)
        return AncestorProtection(self.sysfs, layout_for(self.sysfs), notes), notes


def test_raised_lowered_to_what_it_held_and_forgotten(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    tier = "kubepods/burstable"
    tree.file(tier).write_text("4096\n")  # someone's value before
    tree.apply({tier: {"memory.min": 100 * MIB + 5}})
    assert tree.value(tier) == 100 * MIB  # whole pages
    assert tree.notes.entries(PROTECTION_NOTES) == {tree.noted(tier): "4096"}
    tree.apply({tier: {"memory.min": 50 * MIB}})  # a pod went
    assert tree.value(tier) == 50 * MIB
    tree.apply({tier: {"memory.min": 0}})  # never below what it held before
    assert tree.value(tier) == 4096
    assert tree.notes.entries(PROTECTION_NOTES) == {}
    tree.apply({})
    assert tree.value(tier) == 4096


def test_a_file_already_holding_enough_is_left_alone(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    tier = "kubepods/burstable"
    tree.file(tier).write_text(str(GIB))  # kubelet's MemoryQoS: the requests
    tree.apply({tier: {"memory.min": 100 * MIB}})
    tree.apply({tier: {"memory.min": GIB}})  # exactly as much: still nothing to do
    assert tree.value(tier) == GIB
    assert tree.notes.entries(PROTECTION_NOTES) == {}
    assert tree.sink.named("cgroup_write") == []


def test_a_value_someone_else_changed_is_theirs(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    tier = "kubepods/burstable"
    tree.apply({tier: {"memory.min": 100 * MIB}})
    tree.file(tier).write_text(str(300 * MIB))  # kubelet, say, after the agent's write
    tree.apply({tier: {"memory.min": 50 * MIB}})
    assert tree.value(tier) == 300 * MIB
    assert tree.notes.entries(PROTECTION_NOTES) == {}


def test_a_value_someone_else_changed_is_not_written_back(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    tier, other = "kubepods/burstable", "kubepods"
    tree.apply({tier: {"memory.min": 100 * MIB}, other: {"memory.min": 100 * MIB}})
    tree.file(tier).write_text(str(300 * MIB))  # kubelet's MemoryQoS, say, after the agent
    assert tree.protection.restore("test") == 1  # memory QoS switched off
    assert (tree.value(tier), tree.value(other)) == (300 * MIB, 0)
    assert tree.notes.entries(PROTECTION_NOTES) == {}


def test_a_gone_pod_cgroup_is_forgotten(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    pod = tree.host.add_pod(ONLINE, tier="burstable")
    rel = tree.host.pod_rel("burstable", ONLINE)
    tree.apply({rel: {"memory.min": 64 * MIB}})
    assert tree.noted(rel) in tree.notes.entries(PROTECTION_NOTES)
    tree.host.remove_pod(pod)
    tree.apply({})
    assert tree.notes.entries(PROTECTION_NOTES) == {}


def test_a_new_run_takes_the_notes_up_and_restores(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    tier = "kubepods/burstable"
    tree.apply({tier: {"memory.min": 100 * MIB, "memory.low": 200 * MIB}})
    again = AncestorProtection(tree.sysfs, layout_for(tree.sysfs),
                               StateFile(str(tmp_path / "state.json")))
    again.apply({tier: {"memory.min": 10 * MIB}}, "test")  # memory.low is no longer wanted
    assert (tree.value(tier), tree.value(tier, "memory.low")) == (10 * MIB, 0)
    assert again.restore("test") == 1
    assert tree.value(tier) == 0
    assert StateFile(str(tmp_path / "state.json")).entries(PROTECTION_NOTES) == {}


def test_after_a_restart_a_file_still_holding_the_last_write_is_written_back(
        tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    tier = "kubepods/burstable"
    tree.file(tier).write_text("4096\n")
    tree.apply({tier: {"memory.min": 100 * MIB}})
    tree.apply({tier: {"memory.min": 60 * MIB}})
    assert tree.notes.entries(WRITTEN_NOTES) == {tree.noted(tier): str(60 * MIB)}
    again, notes = tree.restarted()
    assert again.restore("test") == 1
    assert tree.value(tier) == 4096
    assert StateFile(notes.path).entries(PROTECTION_NOTES) == {}
    assert StateFile(notes.path).entries(WRITTEN_NOTES) == {}


@pytest.mark.parametrize("restore", ["switched off", "reset"])
def test_after_a_restart_a_value_someone_else_changed_is_not_written_back(
        tmp_path: Path, restore: str) -> None:
    tree = Tree(tmp_path)
    tier, other = "kubepods/burstable", "kubepods"
    tree.apply({tier: {"memory.min": 100 * MIB}, other: {"memory.min": 100 * MIB}})
    tree.file(tier).write_text(str(100 * MIB + 4096))  # kubelet, say, one page more
    again, notes = tree.restarted()
    with capture_logs() as logs:
        written = (again.restore("test") if restore == "switched off"
                   else restore_protection(tree.sysfs, notes, "nri-qos reset"))
    assert written == 1
    assert (tree.value(tier), tree.value(other)) == (100 * MIB + 4096, 0)
    assert StateFile(notes.path).entries(PROTECTION_NOTES) == {}
    assert StateFile(notes.path).entries(WRITTEN_NOTES) == {}
    [left] = [r for r in logs if r["event"] == "protection_changed_by_someone_else"]
    assert (left["path"], left["written"], left["current"]) == (
        tree.noted(tier), str(100 * MIB), 100 * MIB + 4096)


def test_after_a_restart_a_value_someone_else_changed_is_theirs(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    tier = "kubepods/burstable"
    tree.apply({tier: {"memory.min": 100 * MIB}})
    tree.file(tier).write_text(str(300 * MIB))
    again, notes = tree.restarted()
    again.apply({tier: {"memory.min": 50 * MIB}}, "test")
    assert tree.value(tier) == 300 * MIB
    assert StateFile(notes.path).entries(PROTECTION_NOTES) == {}


def test_a_note_without_the_last_write_is_written_back_whatever_the_file_holds(
        tmp_path: Path) -> None:
    """A state file with the protection section alone, as an agent that kept no last write
    leaves it."""
    tree = Tree(tmp_path)
    tier = "kubepods/burstable"
    tree.file(tier).write_text(str(300 * MIB))
    (tmp_path / "state.json").write_text(
        json.dumps({PROTECTION_NOTES: {tree.noted(tier): "4096"}}))
    again, notes = tree.restarted()
    assert again.restore("test") == 1
    assert tree.value(tier) == 4096
    assert StateFile(notes.path).entries(PROTECTION_NOTES) == {}


def test_a_last_write_without_its_files_note_is_dropped_by_a_restore(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    tree.notes.put(WRITTEN_NOTES, tree.noted("kubepods"), str(MIB))
    assert restore_protection(tree.sysfs, tree.notes, "test") == 0
    assert tree.value("kubepods") == 0
    assert StateFile(tree.notes.path).entries(WRITTEN_NOTES) == {}


def test_no_last_write_is_noted_while_a_write_is_under_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash during the write leaves a note that writes back the value from before, not one
    that takes the write for someone else's change."""
    tree = Tree(tmp_path)
    tier = "kubepods/burstable"
    tree.apply({tier: {"memory.min": 100 * MIB}})
    on_disk: list[dict[str, str]] = []
    write = tree.sysfs.write_if_changed

    def watched(path: str, value: str, reason: str) -> Outcome:
        on_disk.append(dict(StateFile(tree.notes.path).entries(WRITTEN_NOTES)))
        return write(path, value, reason)

    monkeypatch.setattr(tree.sysfs, "write_if_changed", watched)
    tree.apply({tier: {"memory.min": 200 * MIB}})
    assert on_disk == [{}]
    assert tree.notes.entries(WRITTEN_NOTES) == {tree.noted(tier): str(200 * MIB)}


def test_a_write_the_kernel_refuses_keeps_the_last_write_noted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = Tree(tmp_path)
    tier = "kubepods/burstable"
    tree.apply({tier: {"memory.min": 100 * MIB}})
    monkeypatch.setattr(tree.sysfs, "write_if_changed",
                        lambda path, value, reason: Outcome.FAILED)
    tree.apply({tier: {"memory.min": 200 * MIB}})
    assert tree.value(tier) == 100 * MIB
    assert StateFile(tree.notes.path).entries(WRITTEN_NOTES) == {tree.noted(tier): str(100 * MIB)}


def test_observe_mode_writes_nothing_and_undoes_an_enforcing_run(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    tier = "kubepods/burstable"
    tree.apply({tier: {"memory.min": 100 * MIB}})
    observing = AncestorProtection(tree.sysfs.observing(lambda: True),
                                   layout_for(tree.sysfs), tree.notes)
    observing.apply({tier: {"memory.min": 200 * MIB}}, "test")
    assert tree.value(tier) == 0
    assert tree.notes.entries(PROTECTION_NOTES) == {}
    assert [r["path"] for r in tree.sink.named("write_observed")] == [tree.noted(tier)]


def test_a_full_state_file_means_no_write(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    full = StateFile(None)
    full.remember = lambda section, key, value: False  # type: ignore[method-assign]
    AncestorProtection(tree.sysfs, layout_for(tree.sysfs), full).apply(
        {"kubepods/burstable": {"memory.min": 100 * MIB}}, "test")
    assert tree.value("kubepods/burstable") == 0


def drift(tree: Tree, cfg: Config) -> tuple[NodeState, DriftLoop]:
    state = NodeState()
    holder = [cfg]
    loop = DriftLoop(lambda: holder[0], state, tree.sysfs, layout_for(tree.sysfs), 16 * GIB,
                     notes=tree.notes)
    loop.holder = holder  # type: ignore[attr-defined]
    return state, loop


def test_drift_protects_the_ancestors_and_undoes_it_when_switched_off(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    host = tree.host
    host.add_pod(ONLINE, tier="burstable", containers=2, memory_limit=GIB,
                 memory_request=256 * MIB)
    host.add_pod(SOLID, tier="guaranteed", memory_limit=GIB, memory_request=GIB)
    host.add_pod(OFFLINE, tier="besteffort")
    cfg = protecting(min_ratio=100, low_ratio=0)
    state, loop = drift(tree, cfg)
    state.replace_all(*host.nri())
    loop.cycle(0.0)
    pod = host.pod_rel("burstable", ONLINE)
    assert tree.value(pod) == 512 * MIB
    assert tree.value("kubepods/burstable") == 512 * MIB
    assert tree.value(host.pod_rel("guaranteed", SOLID)) == GIB
    assert tree.value("kubepods") == GIB + 512 * MIB
    assert tree.value("kubepods/besteffort") == 0
    assert tree.value(pod, "memory.low") == 0

    # the online pod goes: its tier and kubepods fall back
    [online] = [p for p in host.pods if p.info.uid == ONLINE]
    host.remove_pod(online)
    state.replace_all(*host.nri())
    loop.cycle(10.0)
    assert tree.value("kubepods/burstable") == 0
    assert tree.value("kubepods") == GIB

    # memory QoS switched off: everything back as it was
    loop.holder[0] = dataclasses.replace(  # type: ignore[attr-defined]
        cfg, memory=dataclasses.replace(cfg.memory, enabled=False))
    loop.cycle(20.0)
    assert tree.value("kubepods") == 0
    assert tree.value(host.pod_rel("guaranteed", SOLID)) == 0
    assert tree.notes.entries(PROTECTION_NOTES) == {}


def test_the_default_policies_carry_memory_low_up_and_no_memory_min(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    tree.host.add_pod(ONLINE, tier="burstable", memory_limit=GIB, memory_request=256 * MIB)
    tree.host.add_pod(OFFLINE, tier="besteffort")
    state, loop = drift(tree, Config())
    state.replace_all(*tree.host.nri())
    loop.cycle(0.0)
    for rel in (f"kubepods/burstable/pod{ONLINE}", "kubepods/burstable", "kubepods"):
        assert tree.value(rel, "memory.low") == 256 * MIB
        assert tree.value(rel) == 0
    assert tree.value("kubepods/besteffort", "memory.low") == 0
    assert set(tree.notes.entries(PROTECTION_NOTES)) == {
        tree.noted(rel, "memory.low")
        for rel in (f"kubepods/burstable/pod{ONLINE}", "kubepods/burstable", "kubepods")}


def test_cgroup_v1_has_no_protection_files_to_write(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=1)
    host.add_pod(ONLINE, tier="burstable", memory_limit=GIB, memory_request=256 * MIB)
    sysfs = SysFs(tmp_path, AuditLog(MemoryAuditSink()))
    notes = StateFile(None)
    state = NodeState()
    loop = DriftLoop(lambda: protecting(100, 0), state, sysfs, layout_for(sysfs), 16 * GIB,
                     notes=notes)
    state.replace_all(*host.nri())
    loop.cycle(0.0)
    assert notes.entries(PROTECTION_NOTES) == {}
    assert not (host.cg("memory", "kubepods") / "memory.min").exists()


def test_a_value_that_does_not_parse_is_logged_and_the_others_still_written(
        tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    pod = tree.host.add_pod(ONLINE, tier="burstable", memory_limit=GIB,
                            memory_request=256 * MIB)
    tree.file("kubepods/burstable").write_text("lots\n")
    state, loop = drift(tree, protecting(min_ratio=100, low_ratio=0))
    state.replace_all(*tree.host.nri())
    with capture_logs() as logs:
        loop.cycle(0.0)
    [failed] = [r for r in logs if r["event"] == "protection_unreadable"]
    assert failed["path"] == tree.noted("kubepods/burstable")
    assert "lots" in failed["error"]
    # the tier's file is left as it is; the container, its pod and kubepods are done
    assert tree.file("kubepods/burstable").read_text() == "lots\n"
    container = tree.host.cg("", pod.containers[0].rel)
    assert int((container / "memory.min").read_text()) == 256 * MIB
    assert tree.value(tree.host.pod_rel("burstable", ONLINE)) == 256 * MIB
    assert tree.value("kubepods") == 256 * MIB
    # a note that does not parse is the same
    tree.notes.put(PROTECTION_NOTES, tree.noted("kubepods"), "garbage")
    with capture_logs() as logs:
        loop.cycle(10.0)
    assert [r["path"] for r in logs if r["event"] == "protection_unreadable"] == [
        tree.noted("kubepods/burstable"), tree.noted("kubepods")]
