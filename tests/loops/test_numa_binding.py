"""NUMA binding of reclaimed pods' cpuset.mems."""

from __future__ import annotations

import dataclasses
import errno
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import NumaNode
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.loops.numa_binding import (
    NUMA_NOTES,
    NumaBindingLoop,
    choose_nodes,
    mems_note,
    restore_bindings,
)
from tests.support.builders import LEVEL, api_pod
from tests.support.fakesys import GIB, FakeHost, FakePod
from tests.support.refusals import refuse_writes

LOW = 1000  # pages; the 4 GiB floor dominates


def setup(tmp_path: Path, version: int, driver: str, *, max_nodes: int = 0,
          state: NodeState | None = None
          ) -> tuple[FakeHost, NumaBindingLoop, MemoryAuditSink, FakePod, FakePod]:
    host = FakeHost(tmp_path, version=version, driver=driver)
    offline = host.add_pod("11111111-0000-0000-0000-000000000001", tier="besteffort",
                           containers=2)
    online = host.add_pod("22222222-0000-0000-0000-000000000002", tier="burstable")
    state = NodeState() if state is None else state
    state.replace_all(*host.nri())
    cfg = Config()
    cfg = dataclasses.replace(cfg, numa=dataclasses.replace(cfg.numa, max_nodes=max_nodes))
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    loop = NumaBindingLoop(lambda: cfg, state, sysfs, layout_for(sysfs), AuditLog(sink))
    return host, loop, sink, offline, online


def mems(host: FakeHost, pod: FakePod, index: int = 0) -> str:
    return (host.cg("cpuset", pod.containers[index].rel) / "cpuset.mems").read_text().strip()


def test_choose_nodes_ranks_by_headroom() -> None:
    nodes = [NumaNode(0, 5 * GIB, 0, 0), NumaNode(1, 20 * GIB, 0, 0),
             NumaNode(2, 3 * GIB, 0, 0), NumaNode(3, 10 * GIB, 0, 0)]
    assert choose_nodes(nodes, 4 * GIB, 1.0, 0) == [0, 1, 3]
    assert choose_nodes(nodes, 4 * GIB, 1.0, 2) == [1, 3]
    assert choose_nodes(nodes, 30 * GIB, 1.0, 0) == []


def test_choice_is_sticky_while_the_chosen_nodes_have_headroom() -> None:
    nodes = [NumaNode(0, 10 * GIB, 0, 0), NumaNode(1, 11 * GIB, 0, 0), NumaNode(2, 12 * GIB, 0, 0)]
    assert choose_nodes(nodes, 4 * GIB, 1.0, 1) == [2]
    assert choose_nodes(nodes, 4 * GIB, 1.0, 1, keep=frozenset({0})) == [0]
    # a kept node under its watermark is dropped
    nodes[0] = NumaNode(0, 3 * GIB, 0, 0)
    assert choose_nodes(nodes, 4 * GIB, 1.0, 1, keep=frozenset({0})) == [2]


def test_v1_binds_reclaimed_pods_and_moves_them_off_a_hot_node(tmp_path: Path) -> None:
    host, loop, sink, offline, online = setup(tmp_path, 1, "cgroupfs")
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (2 * GIB, 64 * GIB, LOW)])
    loop.cycle(0.0)
    assert [mems(host, offline, i) for i in (0, 1)] == ["0", "0"]
    assert mems(host, online) == ""
    migrate = host.cg("cpuset", offline.containers[0].rel) / "cpuset.memory_migrate"
    assert migrate.read_text() == "1"
    records = sink.named("numa_binding")
    assert [r["container"] for r in records] == ["c0", "c1"]
    assert records[0]["pod_uid"] == offline.info.uid
    assert records[0]["mems"] == "0"

    loop.cycle(10.0)  # idle
    assert len(sink.named("numa_binding")) == 2

    # node 0 falls under its watermark, node 1 recovers: the pods move
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (30 * GIB, 64 * GIB, LOW)])
    loop.cycle(20.0)
    assert [mems(host, offline, i) for i in (0, 1)] == ["1", "1"]
    assert "nodes under watermark or not chosen: 0" in sink.named("numa_binding")[-1]["reason"]


def test_a_pod_no_longer_reclaimed_gets_its_nodes_and_migration_back(tmp_path: Path) -> None:
    state = NodeState()
    host, loop, _, offline, online = setup(tmp_path, 1, "cgroupfs", state=state)
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (2 * GIB, 64 * GIB, LOW)])
    state.apply_meta(api_pod(online.info.uid, online.info.name, {LEVEL: "reclaimed_cores"}))
    loop.cycle(0.0)
    migrate = host.cg("cpuset", online.containers[0].rel) / "cpuset.memory_migrate"
    assert (mems(host, online), migrate.read_text()) == ("0", "1")
    state.apply_meta(api_pod(online.info.uid, online.info.name, {}))  # shared_cores again
    loop.cycle(10.0)
    assert (mems(host, online), migrate.read_text().strip()) == ("", "0")
    assert mems(host, offline) == "0"  # still reclaimed: still bound


def test_switched_off_the_binding_gives_v1_migration_back(tmp_path: Path) -> None:
    host, _, sink, offline, _ = setup(tmp_path, 1, "cgroupfs")
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (2 * GIB, 64 * GIB, LOW)])
    state = NodeState()
    state.replace_all(*host.nri())
    sysfs = SysFs(tmp_path, AuditLog(sink))
    notes = StateFile(None)

    def loop(cfg: Config) -> NumaBindingLoop:
        return NumaBindingLoop(lambda: cfg, state, sysfs, layout_for(sysfs), AuditLog(sink),
                               notes=notes)

    on = Config()
    migrate = host.cg("cpuset", offline.containers[0].rel) / "cpuset.memory_migrate"
    loop(on).cycle(0.0)
    assert (mems(host, offline), migrate.read_text()) == ("0", "1")
    loop(dataclasses.replace(on, numa=dataclasses.replace(on.numa, enabled=False))).cycle(10.0)
    assert (mems(host, offline), migrate.read_text().strip()) == ("", "0")
    assert notes.entries(NUMA_NOTES) == {}


def test_v2_systemd_four_nodes_best_two(tmp_path: Path) -> None:
    host, loop, sink, offline, _ = setup(tmp_path, 2, "systemd", max_nodes=2)
    host.set_numa([(10 * GIB, 64 * GIB, LOW), (30 * GIB, 64 * GIB, LOW),
                   (1 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    loop.cycle(0.0)
    assert mems(host, offline) == "1,3"
    # v2 migrates by itself: no memory_migrate file is involved
    assert all(not r["path"].endswith("memory_migrate") for r in sink.named("cgroup_write"))


def test_single_node_is_a_no_op(tmp_path: Path) -> None:
    host, loop, sink, offline, _ = setup(tmp_path, 1, "cgroupfs")
    host.set_numa([(20 * GIB, 64 * GIB, LOW)])
    loop.cycle(0.0)
    assert mems(host, offline) == ""
    assert sink.records == []


@pytest.mark.parametrize(("version", "driver"), [(1, "cgroupfs"), (2, "systemd")])
def test_all_nodes_hot_leaves_bindings_alone(tmp_path: Path, version: int, driver: str) -> None:
    host, loop, sink, offline, _ = setup(tmp_path, version, driver)
    host.set_numa([(1 * GIB, 64 * GIB, LOW), (2 * GIB, 64 * GIB, LOW)])
    loop.cycle(0.0)
    assert mems(host, offline) == ""
    assert sink.records == []


def test_equal_binding_in_another_spelling_is_not_rewritten(tmp_path: Path) -> None:
    host, loop, sink, offline, _ = setup(tmp_path, 2, "systemd")
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    for c in offline.containers:
        (host.cg("", c.rel) / "cpuset.mems").write_text("0-1\n")
    loop.cycle(0.0)
    assert sink.records == []


@pytest.mark.parametrize(("version", "driver"), [(1, "cgroupfs"), (2, "systemd")])
def test_one_unbindable_container_does_not_stop_the_others(tmp_path: Path, version: int,
                                                           driver: str) -> None:
    host, loop, sink, offline, _ = setup(tmp_path, version, driver)
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (2 * GIB, 64 * GIB, LOW)])
    broken, healthy = offline.containers
    # A cpuset.mems that cannot be read or written as a file.
    mems_file = host.cg("cpuset", broken.rel) / "cpuset.mems"
    mems_file.unlink()
    mems_file.mkdir()
    with capture_logs() as logs:
        loop.cycle(0.0)
    failed = [e for e in logs if e["event"] == "numa_binding_failed"]
    assert [(e["container"], e["pod_uid"]) for e in failed] == [("c0", offline.info.uid)]
    assert "Is a directory" in failed[0]["error"]
    assert mems(host, offline, 1) == "0"
    assert [r["container"] for r in sink.named("numa_binding")] == [healthy.info.name]


# -- an empty cpuset.mems given back --------------------------------------------------------------

EFFECTIVE = {1: "cpuset.effective_mems", 2: "cpuset.mems.effective"}


def bound_container(tmp_path: Path, version: int) -> tuple[FakeHost, Path, str]:
    """A container bound to node 0 while its pod was ``reclaimed_cores`` (a Burstable pod,
    ``shared_cores`` now): its cpuset directory and the system path of its cpuset.mems."""
    host = FakeHost(tmp_path, version=version, driver="cgroupfs")
    [container] = host.add_pod("33333333-0000-0000-0000-000000000003",
                               tier="burstable").containers
    cpuset = host.cg("cpuset", container.rel)
    (cpuset / "cpuset.mems").write_text("0\n")
    prefix = "/sys/fs/cgroup" if version == 2 else "/sys/fs/cgroup/cpuset"
    return host, cpuset, f"{prefix}/{container.rel}/cpuset.mems"


@pytest.mark.parametrize("version", [1, 2])
def test_an_empty_note_goes_back_as_the_nodes_the_parent_has_in_effect(
        tmp_path: Path, version: int) -> None:
    _, cpuset, path = bound_container(tmp_path, version)
    (cpuset.parent / EFFECTIVE[version]).write_text("0-1\n")
    notes = StateFile(None)
    notes.put(NUMA_NOTES, path, "")  # an earlier agent's note of an empty cpuset.mems
    sink = MemoryAuditSink()
    assert restore_bindings(SysFs(tmp_path, AuditLog(sink)), notes, "test") == 1
    assert (cpuset / "cpuset.mems").read_text() == "0-1"
    assert notes.entries(NUMA_NOTES) == {}
    assert sink.named("cgroup_write_failed") == []


@pytest.mark.parametrize("version", [1, 2])
def test_an_empty_cpuset_mems_is_noted_as_the_nodes_it_has_in_effect(
        tmp_path: Path, version: int) -> None:
    _, cpuset, path = bound_container(tmp_path, version)
    (cpuset / EFFECTIVE[version]).write_text("1\n")
    sysfs = SysFs(tmp_path)
    assert mems_note(sysfs, path.rsplit("/", 1)[0], "\n") == "1"
    assert mems_note(sysfs, path.rsplit("/", 1)[0], "0\n") == "0"


def refusing(monkeypatch: pytest.MonkeyPatch, code: int, *, empty_only: bool = True) -> None:
    """cpuset.mems writes (of an empty value only: the kernel's ENOSPC to a cgroup with
    processes) refused with ``code``."""
    refuse_writes(monkeypatch, code, lambda real, data: real.endswith("/cpuset.mems")
                  and not (empty_only and data.strip()))


@pytest.mark.parametrize(("noted", "code", "dropped"), [
    ("", errno.ENOSPC, True), ("", errno.EACCES, False), ("0-1", errno.ENOSPC, False)])
def test_only_an_empty_note_the_kernel_refuses_with_enospc_is_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noted: str, code: int,
        dropped: bool) -> None:
    _, cpuset, path = bound_container(tmp_path, 2)  # the parent's nodes cannot be read
    refusing(monkeypatch, code, empty_only=not noted)
    notes = StateFile(None)
    notes.put(NUMA_NOTES, path, noted)
    with capture_logs() as logs:
        assert restore_bindings(SysFs(tmp_path), notes, "test") == 0
    assert (cpuset / "cpuset.mems").read_text() == "0\n"
    assert notes.entries(NUMA_NOTES) == ({} if dropped else {path: noted})
    abandoned = [e for e in logs if e["event"] == "restore_abandoned"]
    assert [(e["section"], e["path"], e["value"]) for e in abandoned] == (
        [(NUMA_NOTES, path, "")] if dropped else [])


def test_a_pod_whose_empty_note_the_kernel_refuses_is_warned_of_once_not_every_cycle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host, cpuset, path = bound_container(tmp_path, 1)
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (2 * GIB, 64 * GIB, LOW)])
    state = NodeState()
    state.replace_all(*host.nri())
    refusing(monkeypatch, errno.ENOSPC)
    notes = StateFile(None)
    notes.put(NUMA_NOTES, path, "")
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    cfg = Config()
    loop = NumaBindingLoop(lambda: cfg, state, sysfs, layout_for(sysfs), AuditLog(sink),
                           notes=notes)
    with capture_logs() as logs:
        for now in (0.0, 10.0, 20.0):
            loop.cycle(now)
    assert [e["path"] for e in logs if e["event"] == "restore_abandoned"] == [path]
    assert [r["path"] for r in sink.named("cgroup_write_failed")] == [path]
    assert notes.entries(NUMA_NOTES) == {}
    assert (cpuset / "cpuset.mems").read_text() == "0\n"
