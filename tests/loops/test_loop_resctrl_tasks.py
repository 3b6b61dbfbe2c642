"""resctrl task-id loop: placing tasks, 1,000 containers, garbage collection, class groups."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
from pathlib import Path
from types import MappingProxyType

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import PodMeta
from common.state import NodeState
from hooks.levels import LEVEL_NAMES
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.resctrlfs import ResctrlFs, read_info
from reconciler.host.sysfs import SysFs
from reconciler.loops.resctrl_tasks import ResctrlTasksLoop
from tests.support.fakesys import FakeHost, read_ids

PREFIX = "nriqos-"
# A pod asking for its own group (the annotation its group is made from).
ASKS = {"qos.nri-qos.io/resctrl": '{"LLC":{"schemata":{"range":[20,80]}}}'}


@dataclasses.dataclass
class World:
    host: FakeHost
    state: NodeState
    loop: ResctrlTasksLoop
    sink: MemoryAuditSink
    resctrl: Path
    config: Config

    def tasks(self, group: str, monitor: bool = False) -> set[int]:
        d = self.resctrl / group
        if monitor:
            d = d / "mon_groups" / group
        return set(read_ids(d / "tasks"))

    def sync(self) -> None:
        self.state.replace_all(*self.host.nri())


def world(tmp_path: Path, version: int = 1, driver: str = "cgroupfs", *,
          full_scan_every: int = 10, gc_grace_s: float = 60.0) -> World:
    host = FakeHost(tmp_path, version=version, driver=driver)
    root = host.make_resctrl()
    for level in LEVEL_NAMES:
        host.add_resctrl_group(PREFIX + level)
    cfg = Config()
    cfg = dataclasses.replace(cfg, reconciler=dataclasses.replace(
        cfg.reconciler, full_scan_every=full_scan_every, gc_grace_s=gc_grace_s))
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit)
    mount = "/" + str(root.relative_to(tmp_path))
    fs = ResctrlFs(sysfs, mount, read_info(sysfs, mount, 2048), prefix=PREFIX, audit=audit)
    state = NodeState()
    loop = ResctrlTasksLoop(lambda: cfg, state, sysfs, layout_for(sysfs), fs, audit)
    return World(host, state, loop, sink, root, cfg)


def uid(n: int) -> str:
    return f"{n:08x}-0000-4000-8000-000000000000"


def test_thousand_containers_reconcile_then_idle(tmp_path: Path) -> None:
    w = world(tmp_path)
    reclaimed = [w.host.add_pod(uid(i), tier="besteffort", containers=2) for i in range(250)]
    shared = [w.host.add_pod(uid(1000 + i), tier="burstable", containers=2) for i in range(250)]
    w.sync()
    w.loop.cycle(0.0)
    want_reclaimed = {t for p in reclaimed for c in p.containers for t in c.tids}
    want_shared = {t for p in shared for c in p.containers for t in c.tids}
    assert len(want_reclaimed) + len(want_shared) == 2000  # 1,000 containers x 2 threads
    assert w.tasks(PREFIX + "reclaimed_cores") == want_reclaimed
    assert w.tasks(PREFIX + "shared_cores") == want_shared
    moved = {r["group"]: r["count"] for r in w.sink.named("tasks_moved")}
    assert moved == {PREFIX + "reclaimed_cores": 1000, PREFIX + "shared_cores": 1000}
    for t in range(1, 12):  # idle cycles, full scans included: nothing more is written
        w.loop.cycle(float(t))
    assert len(w.sink.named("tasks_moved")) == 2


def test_task_entering_from_outside_is_found_between_full_scans(tmp_path: Path) -> None:
    w = world(tmp_path, full_scan_every=100)
    pod = w.host.add_pod(uid(1), tier="besteffort")
    w.host.add_system_task(1)
    (w.resctrl / "tasks").write_text("1\n")
    w.sync()
    w.loop.cycle(0.0)
    # an exec'd process lands in the container's cgroup and in the root resctrl group
    new = w.host.add_process(pod.containers[0], threads=2)
    with (w.resctrl / "tasks").open("a") as f:
        f.write("".join(f"{t}\n" for t in new))
    w.loop.cycle(1.0)
    assert set(new) <= w.tasks(PREFIX + "reclaimed_cores")
    assert 1 not in w.tasks(PREFIX + "reclaimed_cores")  # system task left alone


def test_full_scan_catches_what_the_cheap_check_cannot_see(tmp_path: Path) -> None:
    w = world(tmp_path, full_scan_every=3)
    pod = w.host.add_pod(uid(1), tier="besteffort")
    w.sync()
    w.loop.cycle(0.0)  # full
    # a task that is in neither the root group nor ours (another tool's group)
    hidden = w.host.add_process(pod.containers[0])
    w.loop.cycle(1.0)
    w.loop.cycle(2.0)
    assert not set(hidden) & w.tasks(PREFIX + "reclaimed_cores")
    w.loop.cycle(3.0)  # full scan
    assert set(hidden) <= w.tasks(PREFIX + "reclaimed_cores")


def test_v2_systemd_uses_cgroup_threads(tmp_path: Path) -> None:
    w = world(tmp_path, 2, "systemd")
    pod = w.host.add_pod(uid(1), tier="guaranteed", threads=4)
    w.sync()
    w.loop.cycle(0.0)
    assert w.tasks(PREFIX + "shared_cores") == set(pod.containers[0].tids)


def test_new_container_is_placed_in_the_next_cycle_without_a_full_scan(tmp_path: Path) -> None:
    w = world(tmp_path, full_scan_every=100)
    w.host.add_pod(uid(1), tier="besteffort")
    w.sync()
    w.loop.cycle(0.0)
    late = w.host.add_pod(uid(2), tier="besteffort")
    w.sync()
    w.loop.cycle(1.0)
    assert set(late.containers[0].tids) <= w.tasks(PREFIX + "reclaimed_cores")


def test_pod_group_with_monitor_group(tmp_path: Path) -> None:
    w = world(tmp_path)
    pod = w.host.add_pod(uid(5), tier="burstable", containers=2, annotations=ASKS)
    group = f"{PREFIX}pod-{uid(5)}"
    w.host.add_resctrl_group(group, monitor=True)
    w.sync()
    w.loop.cycle(0.0)
    tids = {t for c in pod.containers for t in c.tids}
    assert w.tasks(group) == tids
    assert w.tasks(group, monitor=True) == tids
    assert not tids & w.tasks(PREFIX + "shared_cores")
    # a task in the control group but not in its monitor group is noticed between full scans
    [extra] = w.host.add_process(pod.containers[0])
    with (w.resctrl / group / "tasks").open("a") as f:
        f.write(f"{extra}\n")
    w.loop.cycle(1.0)
    assert extra in w.tasks(group, monitor=True)


def test_level_change_through_the_pod_watch_moves_tasks(tmp_path: Path) -> None:
    w = world(tmp_path, full_scan_every=100)
    pod = w.host.add_pod(uid(7), tier="burstable")
    w.sync()
    w.loop.cycle(0.0)
    tids = set(pod.containers[0].tids)
    assert tids <= w.tasks(PREFIX + "shared_cores")
    w.state.apply_meta(PodMeta(
        uid=uid(7), namespace="default", name=pod.info.name,
        annotations=MappingProxyType({"qos.nri-qos.io/level": "reclaimed_cores"}),
        labels=MappingProxyType({}), priority=None,
        memory_requests=MappingProxyType({}), memory_limits=MappingProxyType({})))
    w.loop.cycle(1.0)
    assert tids <= w.tasks(PREFIX + "reclaimed_cores")


def test_orphan_pod_groups_are_removed_after_the_grace_period(tmp_path: Path) -> None:
    w = world(tmp_path, gc_grace_s=30.0)
    w.host.add_pod(uid(1), tier="burstable", annotations=ASKS)
    live = f"{PREFIX}pod-{uid(1)}"
    orphan = f"{PREFIX}pod-{uid(2)}"
    foreign = "someone-else"
    for g in (live, orphan, foreign):
        w.host.add_resctrl_group(g, monitor=True)
    # before the first NRI state nothing is known to be gone, not even once the pod watch has
    # delivered pods (it may be up while the runtime is not)
    w.loop.cycle(0.0)
    w.state.apply_meta(PodMeta(uid=uid(1), namespace="default", name="p1",
                               annotations=MappingProxyType(ASKS), labels=MappingProxyType({}),
                               priority=None,
                               memory_requests=MappingProxyType({}),
                               memory_limits=MappingProxyType({}), deleted=False))
    w.loop.cycle(100.0)
    w.loop.cycle(140.0)  # past the grace period
    assert (w.resctrl / orphan).is_dir()
    w.sync()
    w.loop.cycle(200.0)
    w.loop.cycle(229.0)
    assert (w.resctrl / orphan).is_dir()
    w.loop.cycle(230.0)
    assert not (w.resctrl / orphan).exists()
    assert (w.resctrl / live).is_dir()
    assert (w.resctrl / foreign).is_dir()
    [removed] = w.sink.named("resctrl_group_removed")
    assert removed["group"] == orphan
    assert uid(2) in removed["reason"]


def test_orphan_that_comes_back_is_kept(tmp_path: Path) -> None:
    w = world(tmp_path, gc_grace_s=30.0)
    w.host.add_resctrl_group(f"{PREFIX}pod-{uid(3)}")
    w.host.add_pod(uid(1), tier="burstable")
    w.sync()
    w.loop.cycle(0.0)
    w.host.add_pod(uid(3), tier="burstable", annotations=ASKS)
    w.sync()
    w.loop.cycle(40.0)
    assert (w.resctrl / f"{PREFIX}pod-{uid(3)}").is_dir()


def test_a_live_pods_group_the_configuration_no_longer_gives_it_goes_after_the_grace_period(
        tmp_path: Path) -> None:
    w = world(tmp_path, gc_grace_s=30.0)
    pod = w.host.add_pod(uid(1), tier="burstable", annotations=ASKS)
    tids = set(pod.containers[0].tids)
    group = f"{PREFIX}pod-{uid(1)}"
    w.host.add_resctrl_group(group, monitor=True)
    w.sync()
    on = w.config
    off = dataclasses.replace(on, resctrl=dataclasses.replace(on.resctrl, pod_groups=False))
    w.loop.cycle(0.0)
    w.loop.cycle(100.0)
    assert w.tasks(group) == tids
    w.loop._config = lambda: off  # the config store's reload, in short
    w.loop.cycle(200.0)
    # Wanted again before the grace period ends: kept, and its age starts anew.
    w.loop._config = lambda: on
    w.loop.cycle(210.0)
    w.loop._config = lambda: off
    w.loop.cycle(220.0)
    w.loop.cycle(249.0)
    assert (w.resctrl / group).is_dir()
    assert w.sink.named("resctrl_group_removed") == []
    # Still there, but no longer the pod's: its tasks are already in their level's group.
    assert w.tasks(PREFIX + "shared_cores") == tids
    w.loop.cycle(250.0)
    assert not (w.resctrl / group).exists()
    assert w.sink.named("resctrl_group_removed") == [{
        "group": group,
        "reason": f"pod {uid(1)}: the configuration gives it no group of its own "
                  "(orphaned for 30 s)"}]
    # The class groups stay, and the pod's tasks are in its level's.
    assert all((w.resctrl / (PREFIX + level)).is_dir() for level in LEVEL_NAMES)
    assert w.tasks(PREFIX + "shared_cores") == tids


def test_a_live_pods_group_the_kernel_will_not_remove_is_tried_again_every_cycle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = world(tmp_path, gc_grace_s=0.0)
    w.host.add_pod(uid(1), tier="burstable", annotations=ASKS)
    group = f"{PREFIX}pod-{uid(1)}"
    w.host.add_resctrl_group(group, monitor=True)
    w.sync()
    # Another annotation key: the pod's no longer asks for a group.
    moved = dataclasses.replace(w.config, resctrl=dataclasses.replace(
        w.config.resctrl, annotation="example.com/resctrl"))
    w.loop._config = lambda: moved
    remove_group = ResctrlFs.remove_group
    tried: list[str] = []

    def busy(self: ResctrlFs, name: str, reason: str) -> bool:
        tried.append(name)
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    monkeypatch.setattr(ResctrlFs, "remove_group", busy)
    with capture_logs() as logs:
        w.loop.cycle(0.0)
        w.loop.cycle(1.0)
    assert tried == [group, group]
    said = [(e["group"], e["error"]) for e in logs if e["event"] == "resctrl_group_not_removed"]
    assert said == [(group, "OSError: Device or resource busy")]
    assert (w.resctrl / group).is_dir()
    monkeypatch.setattr(ResctrlFs, "remove_group", remove_group)
    w.loop.cycle(2.0)
    assert not (w.resctrl / group).exists()
    assert [r["group"] for r in w.sink.named("resctrl_group_removed")] == [group]


@pytest.mark.parametrize("level", ["reclaimed_cores", "shared_cores"])
def test_removed_class_group_is_recreated_and_refilled(tmp_path: Path, level: str) -> None:
    w = world(tmp_path)
    tier = "besteffort" if level == "reclaimed_cores" else "burstable"
    pod = w.host.add_pod(uid(1), tier=tier)
    w.sync()
    w.loop.cycle(0.0)
    # The first cycle gave the fake tree's class groups their configured schemata.
    w.sink.records.clear()
    group = w.resctrl / (PREFIX + level)
    for f in group.iterdir():
        f.unlink()
    group.rmdir()
    w.loop.cycle(1.0)
    assert group.is_dir()
    [created] = w.sink.named("resctrl_group_created")
    assert created["group"] == PREFIX + level
    if level == "reclaimed_cores":
        assert "L3:0=f;1=f" in created["schemata"]  # 0-30 % of 11 ways, rounded up: 4
    assert set(pod.containers[0].tids) <= w.tasks(PREFIX + level)


def without_shared_cores(w: World) -> None:
    """The config store's reload of a configuration whose shared_cores level is disabled, in
    short."""
    base = Config()
    levels = dict(base.resctrl.levels)
    levels["shared_cores"] = dataclasses.replace(levels["shared_cores"], enabled=False)
    cfg = dataclasses.replace(base, resctrl=dataclasses.replace(
        base.resctrl, levels=MappingProxyType(levels)))
    w.loop._config = lambda: cfg


def test_disabled_level_is_not_managed(tmp_path: Path) -> None:
    w = world(tmp_path)
    without_shared_cores(w)
    w.host.add_pod(uid(1), tier="burstable")
    w.sync()
    w.loop.cycle(0.0)
    # As on a reload: the level's class group goes, and none of its tasks was moved anywhere.
    assert not (w.resctrl / (PREFIX + "shared_cores")).exists()
    assert [r["group"] for r in w.sink.named("resctrl_group_removed")] == [
        PREFIX + "shared_cores"]
    assert w.sink.named("tasks_moved") == []


def test_a_disabled_levels_group_the_kernel_will_not_remove_holds_up_no_task_move(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = world(tmp_path)
    without_shared_cores(w)
    pod = w.host.add_pod(uid(1), tier="besteffort")
    w.sync()
    remove_group = ResctrlFs.remove_group

    def busy(self: ResctrlFs, name: str, reason: str) -> bool:
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    monkeypatch.setattr(ResctrlFs, "remove_group", busy)
    with capture_logs() as logs:
        w.loop.cycle(0.0)
        w.loop.cycle(1.0)
    # The other levels' tasks are placed all the same; the refusal is said once.
    assert set(pod.containers[0].tids) <= w.tasks(PREFIX + "reclaimed_cores")
    said = [e["error"] for e in logs if e["event"] == "resctrl_class_group_failed"]
    assert said == [f"resctrl class group {PREFIX}shared_cores of level shared_cores, disabled, "
                    "not removed: OSError: Device or resource busy"]
    monkeypatch.setattr(ResctrlFs, "remove_group", remove_group)
    w.loop.cycle(2.0)
    assert not (w.resctrl / (PREFIX + "shared_cores")).exists()


def test_monitor_group_made_after_its_group_is_used_from_the_next_full_scan(
        tmp_path: Path) -> None:
    w = world(tmp_path, full_scan_every=2)
    pod = w.host.add_pod(uid(6), tier="burstable", annotations=ASKS)
    group = f"{PREFIX}pod-{uid(6)}"
    w.host.add_resctrl_group(group)
    w.sync()
    w.loop.cycle(0.0)
    (w.resctrl / group / "mon_groups" / group).mkdir(parents=True)
    (w.resctrl / group / "mon_groups" / group / "tasks").write_text("")
    w.loop.cycle(1.0)
    w.loop.cycle(2.0)  # full scan
    assert w.tasks(group, monitor=True) == set(pod.containers[0].tids)


def test_a_refused_move_is_logged_and_the_other_groups_moves_land(tmp_path: Path) -> None:
    w = world(tmp_path, full_scan_every=100)
    watched = w.host.add_pod(uid(5), tier="burstable", annotations=ASKS)
    group = f"{PREFIX}pod-{uid(5)}"
    w.host.add_resctrl_group(group, monitor=True)
    other = w.host.add_pod(uid(6), tier="besteffort")
    w.sync()
    w.loop.cycle(0.0)
    assert w.tasks(group, monitor=True) == set(watched.containers[0].tids)
    # The monitor group vanishes (its RMID gone) between full scans: writing its tasks file
    # fails with ENOENT, not EROFS.
    shutil.rmtree(w.resctrl / group / "mon_groups" / group)
    new_watched = w.host.add_process(watched.containers[0])
    new_other = w.host.add_process(other.containers[0])
    with (w.resctrl / "tasks").open("a") as f:
        f.write("".join(f"{t}\n" for t in (*new_watched, *new_other)))
    with capture_logs() as logs:
        w.loop.cycle(1.0)
    failed = [e for e in logs if e["event"] == "resctrl_task_move_failed"]
    # Every id of the pod's container was to go to the monitor group (the new one included).
    assert set(new_watched) <= set(watched.containers[0].tids)
    assert [(e["group"], e["monitor"], e["count"]) for e in failed] == [
        (group, True, len(watched.containers[0].tids))]
    assert "No such file or directory" in failed[0]["error"]
    # The same cycle's other moves landed: the control group's and the class group's.
    assert set(new_watched) <= w.tasks(group)
    assert set(new_other) <= w.tasks(PREFIX + "reclaimed_cores")


def test_resctrl_switched_off_removes_our_groups_and_back_on_places_every_container(
        tmp_path: Path) -> None:
    w = world(tmp_path, full_scan_every=100)
    reclaimed = w.host.add_pod(uid(1), tier="besteffort")
    shared = w.host.add_pod(uid(2), tier="burstable", annotations=ASKS)
    group = f"{PREFIX}pod-{uid(2)}"
    w.host.add_resctrl_group(group, monitor=True)
    w.host.add_resctrl_group("COS1")
    w.sync()
    w.loop.cycle(0.0)
    assert w.tasks(PREFIX + "reclaimed_cores") == set(reclaimed.containers[0].tids)
    assert w.tasks(group) == set(shared.containers[0].tids)
    moves = len(w.sink.named("tasks_moved"))
    on = w.config
    off = dataclasses.replace(on, resctrl=dataclasses.replace(on.resctrl, enabled=False))
    w.loop._config = lambda: off  # the config store's reload, in short
    w.loop.cycle(1.0)
    assert sorted(p.name for p in w.resctrl.iterdir() if p.name.startswith(("nriqos-", "COS"))) \
        == ["COS1"]
    assert sorted((r["group"], r["reason"]) for r in w.sink.named("resctrl_group_removed")) == [
        (name, "resctrl.enabled is false")
        for name in sorted([*(PREFIX + level for level in LEVEL_NAMES), group])]
    w.loop.cycle(2.0)
    assert len(w.sink.named("resctrl_group_removed")) == 5
    assert len(w.sink.named("tasks_moved")) == moves
    # Switched on again (the reload made the class groups anew): the next cycle reads every
    # container's threads, whatever the full-scan cadence.
    for level in LEVEL_NAMES:
        w.host.add_resctrl_group(PREFIX + level)
    w.loop._config = lambda: on
    w.loop.cycle(3.0)
    assert w.tasks(PREFIX + "reclaimed_cores") == set(reclaimed.containers[0].tids)
    assert w.tasks(PREFIX + "shared_cores") == set(shared.containers[0].tids)
