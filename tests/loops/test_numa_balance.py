"""NUMA balance: the loop on a fake v2 tree with a mover standing in for move_pages(2) (the planner:
``test_numa_balance_plan.py``)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from common.audit import AuditLog
from reconciler.host.cgroups import layout_for
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.loops.numa_balance import (
    NOTHING_TO_BALANCE_RECHECK_S,
    RESIDUE_BYTES,
    NumaBalanceLoop,
)
from reconciler.loops.numa_binding import (
    NUMA_BALANCE_NOTES,
    NUMA_NOTES,
    NumaBindingLoop,
    restore_bindings,
)
from reconciler.metrics import ReconcilerMetrics
from tests.support.builders import LEVEL, api_pod
from tests.support.fakesys import GIB, MIB
from tests.support.numa_balance_env import (
    LOW,
    UID,
    WEB,
    FakeMover,
    loop_of,
    mems,
    setup,
    stat_of,
)
from tests.support.numa_stat import read_stat, write_stat

# -- the loop on a fake tree -----------------------------------------------------------------------

def test_steps_move_the_offline_pod_off_the_hot_node_then_narrow_its_binding(
        tmp_path: Path) -> None:
    host, offline, online, cfg, sysfs, sink, state = setup(tmp_path)
    mover = FakeMover(stat_of(host, offline))
    notes = StateFile(str(tmp_path / "state.json"))
    metrics = ReconcilerMetrics()
    clock = [10.0]
    loop = loop_of(cfg, state, sysfs, sink, mover, notes, metrics, clock)
    loop.cycle(0.0)
    # widened first (the kernel refuses pages onto a node outside the cpuset), then one step
    assert mover.calls == [([offline.containers[0].pids[0]], 0, 1, 64 * MIB, 5.0)]
    assert mems(host, offline) == "0-1"
    [step] = sink.named("numa_balance_step")
    assert step == {"pod_uid": UID, "container": "c0", "from_node": 0, "to_node": 1,
                    "asked_bytes": 64 * MIB, "moved_bytes": 64 * MIB, "duration_s": 0.0,
                    "result": "done", "dry_run": False, "reason": step["reason"]}
    assert step["reason"].startswith("node 0 1073741824 bytes under its watermark")
    # 64 MiB at 128 MiB/s: the next step waits half a second, and the next cycle with it
    assert loop.interval() == 1.0
    loop.cycle(1.0)
    assert len(mover.calls) == 1
    assert loop.interval() == 0.5
    clock[0] = 10.25
    assert loop.interval() == 0.25
    clock[0] = 10.49
    assert loop.interval() == 0.05  # never less, however short the rate limit's wait
    clock[0] = 10.5
    loop.cycle(2.0)
    clock[0] = 11.0
    loop.cycle(3.0)
    assert [c[3] for c in mover.calls] == [64 * MIB, 64 * MIB, 64 * MIB]
    assert mems(host, offline) == "0-1"
    clock[0] = 12.0
    loop.cycle(4.0)  # 8 MiB left: asked and moved, less than a step: the node is taken out
    assert mover.calls[-1][3] == 8 * MIB
    assert mems(host, offline) == "1"
    clock[0] = 13.0
    loop.cycle(5.0)  # nothing left to move
    assert len(mover.calls) == 4
    assert mems(host, online) == "0"
    assert read_stat(stat_of(host, online)) == {0: 3 * GIB, 1: 0}
    get = metrics.registry.get_sample_value
    assert get("nri_qos_numa_balance_steps_total", {"result": "done"}) == 4
    assert get("nri_qos_numa_balance_moved_bytes_total") == 200 * MIB
    assert get("nri_qos_numa_balance_step_duration_seconds_count") == 4
    # undone as nri-qos reset does it
    path = f"/sys/fs/cgroup/{offline.containers[0].rel}/cpuset.mems"
    assert notes.entries(NUMA_BALANCE_NOTES) == {path: "0"}
    assert notes.entries(NUMA_NOTES) == {}
    assert restore_bindings(sysfs, notes, "reset", NUMA_BALANCE_NOTES) == 1
    assert mems(host, offline) == "0"


def test_stops_when_the_hot_node_recovers(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    mover = FakeMover(stat_of(host, offline))
    clock = [0.0]
    loop = loop_of(cfg, state, sysfs, sink, mover, clock=clock)
    loop.cycle(0.0)
    host.set_numa([(4 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    clock[0] = 5.0
    loop.cycle(1.0)
    assert len(mover.calls) == 1


def test_on_a_node_nothing_presses_no_containers_memory_is_read(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    host.set_numa([(4 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    loop = loop_of(cfg, state, sysfs, sink, FakeMover(stat_of(host, offline)))
    loop.cycle(0.0)
    assert sysfs.reads
    assert not [p for p in sysfs.reads if "numa_stat" in p or "cpuset" in p]
    # the nodes listed once a cycle; the zones' watermarks read (and the nodes listed with
    # them) once a minute
    assert sysfs.listed == {"/sys/devices/system/node": 2}
    assert sysfs.reads["/proc/zoneinfo"] == 1
    sysfs.clear()
    loop.cycle(0.5)
    assert sysfs.listed == {"/sys/devices/system/node": 1}
    assert "/proc/zoneinfo" not in sysfs.reads
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    loop.cycle(1.0)
    assert [p for p in sysfs.reads if p.endswith("/memory.numa_stat")]


def test_without_a_reclaimed_container_the_nodes_memory_is_not_read(tmp_path: Path) -> None:
    host, offline, online, cfg, sysfs, sink, state = setup(tmp_path)  # node 0 under its mark
    state.replace_all([online.info], [c.info for c in online.containers])
    mover = FakeMover(stat_of(host, offline))
    loop = loop_of(cfg, state, sysfs, sink, mover)
    loop.cycle(0.0)
    assert not sysfs.reads
    assert loop.interval() == cfg.numa_balance.quiet_interval_s == 5.0
    # one comes: the nodes are read and its memory moved at the next cycle
    state.replace_all(*host.nri())
    loop.cycle(1.0)
    assert any(p.endswith("/meminfo") for p in sysfs.reads)
    [step] = sink.named("numa_balance_step")
    assert step["pod_uid"] == offline.info.uid
    assert step["result"] == "done"


def test_while_no_node_is_under_its_watermark_the_loop_looks_every_quiet_interval(
        tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    loop = loop_of(cfg, state, sysfs, sink, FakeMover(stat_of(host, offline)))
    four = 4 * GIB  # the floor: a node with exactly this free is not under its watermark
    host.set_numa([(four, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    loop.cycle(0.0)
    assert loop.interval() == 5.0
    host.set_numa([(four - 4096, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    loop.cycle(5.0)
    assert len(sink.named("numa_balance_step")) == 1
    assert loop.interval() == 1.0
    # a quiet period under the busy one is the busy one
    fast = dataclasses.replace(cfg, numa_balance=dataclasses.replace(
        cfg.numa_balance, interval_s=3.0, quiet_interval_s=0.5))
    host.set_numa([(four, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    other = loop_of(fast, state, sysfs, sink, None)
    other.cycle(0.0)
    assert other.interval() == 3.0


def test_the_configured_smallest_step_holds_steps_back_while_the_cool_node_is_short(
        tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    cfg = dataclasses.replace(cfg, numa_balance=dataclasses.replace(
        cfg.numa_balance, min_step_bytes=32 * MIB))
    mover = FakeMover(stat_of(host, offline))
    clock = [0.0]
    loop = loop_of(cfg, state, sysfs, sink, mover, clock=clock)
    # node 0's watermark, 4 GiB, is every node's: node 1 has 64 MiB less a page above it
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (4 * GIB + 64 * MIB - 4096, 64 * GIB, LOW)])
    loop.cycle(0.0)
    assert mover.calls == []
    assert mems(host, offline) == "0"
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (4 * GIB + 64 * MIB, 64 * GIB, LOW)])
    loop.cycle(1.0)
    assert [c[3] for c in mover.calls] == [32 * MIB]


def test_while_no_step_can_be_taken_the_loop_looks_every_quiet_interval(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    mover = FakeMover(stat_of(host, offline))
    loop = loop_of(cfg, state, sysfs, sink, mover)
    four = 4 * GIB  # every node's watermark
    cases = {
        # every node short, as on a busy node whose page cache fills its memory
        "no NUMA node has headroom": [(3 * GIB, 64 * GIB, LOW), (four, 64 * GIB, LOW)],
        # half of node 1's room, 16 MiB less half a page, is under the 16 MiB smallest step
        "half of it is under a step": [(3 * GIB, 64 * GIB, LOW),
                                       (four + 32 * MIB - 4096, 64 * GIB, LOW)],
        # node 1 is the hot one, and the reclaimed pod holds nothing there
        "no reclaimed pod holds memory": [(20 * GIB, 64 * GIB, LOW), (3 * GIB, 64 * GIB, LOW)],
    }
    for at, (why, nodes) in enumerate(cases.items()):
        host.set_numa(nodes)
        loop.cycle(float(at))
        assert mover.calls == []
        assert loop.interval() == 5.0, why
    # room for the smallest step: a step, and the busy period again
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (four + 32 * MIB, 64 * GIB, LOW)])
    loop.cycle(3.0)
    assert [c[3] for c in mover.calls] == [16 * MIB]
    assert loop.interval() == 1.0


def test_dry_run_audits_the_step_once_and_changes_nothing(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path, dry_run=True)
    mover = FakeMover(stat_of(host, offline))
    clock = [0.0]
    loop = loop_of(cfg, state, sysfs, sink, mover, clock=clock)
    for at in range(5):
        clock[0] = float(at)
        loop.cycle(float(at))
    assert mover.calls == []
    assert mems(host, offline) == "0"
    [step] = sink.named("numa_balance_step")
    assert (step["result"], step["dry_run"], step["moved_bytes"]) == ("dry_run", True, 0)
    assert sink.named("cgroup_write") == []


def test_observe_mode_holds_the_widening_and_the_move(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path, observe=True)
    clock = [0.0]
    loop = loop_of(cfg, state, sysfs, sink, None, clock=clock)  # the real mover
    for at in range(3):
        clock[0] = float(at)
        loop.cycle(float(at))
    assert mems(host, offline) == "0"
    [widen, move] = sink.named("write_observed")
    assert widen["value"] == "0-1"
    assert move["reason"] == "NUMA balance step"
    [step] = sink.named("numa_balance_step")
    assert (step["result"], step["moved_bytes"]) == ("observed", 0)


def test_a_refused_move_is_audited_and_the_container_left_for_a_minute(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    mover = FakeMover(stat_of(host, offline), Outcome.FAILED)
    metrics = ReconcilerMetrics()
    clock = [100.0]
    loop = loop_of(cfg, state, sysfs, sink, mover, metrics=metrics, clock=clock)
    loop.cycle(0.0)
    [step] = sink.named("numa_balance_step")
    assert (step["result"], step["reason"]) == ("failed", "EACCES: refused")
    assert mems(host, offline) == "0-1"
    assert metrics.registry.get_sample_value(
        "nri_qos_numa_balance_steps_total", {"result": "failed"}) == 1
    clock[0] = 159.99
    loop.cycle(1.0)
    assert len(mover.calls) == 1
    clock[0] = 160.0
    loop.cycle(2.0)
    assert len(mover.calls) == 2


class RefusingSysFs(SysFs):
    """The kernel refuses every cpuset.mems write (EINVAL: a node the parent does not allow)."""

    def write(self, path: str, value: str, reason: str, *, create: bool = False) -> Outcome:
        if path.endswith("/cpuset.mems"):
            return Outcome.FAILED
        return super().write(path, value, reason, create=create)


def test_a_cpuset_the_kernel_will_not_widen_is_a_failed_step(tmp_path: Path) -> None:
    host, offline, _, cfg, _, sink, state = setup(tmp_path)
    mover = FakeMover(stat_of(host, offline))
    clock = [100.0]
    loop = loop_of(cfg, state, RefusingSysFs(tmp_path, AuditLog(sink)), sink, mover,
                   clock=clock)
    loop.cycle(0.0)
    clock[0] = 110.0
    loop.cycle(1.0)
    assert mover.calls == []
    [step] = sink.named("numa_balance_step")
    assert (step["result"], step["reason"]) == ("failed", "cpuset.mems not widened to node 1")


def test_switched_off_or_on_cgroup_v1_nothing_moves(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    off = dataclasses.replace(cfg, numa_balance=dataclasses.replace(cfg.numa_balance,
                                                                    enabled=False))
    mover = FakeMover(stat_of(host, offline))
    loop_of(off, state, sysfs, sink, mover).cycle(0.0)
    assert mover.calls == []
    host1, offline1, _, cfg1, sysfs1, sink1, state1 = setup(tmp_path / "v1", version=1)
    mover1 = FakeMover(stat_of(host1, offline1))
    loop_of(cfg1, state1, sysfs1, sink1, mover1).cycle(0.0)
    assert mover1.calls == []


def test_with_nothing_to_balance_the_loop_looks_again_every_minute(tmp_path: Path) -> None:
    assert NOTHING_TO_BALANCE_RECHECK_S == 60.0
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    loop = loop_of(cfg, state, sysfs, sink, FakeMover(stat_of(host, offline)))
    assert loop.interval() == cfg.numa_balance.interval_s == 1.0
    # one NUMA node: nothing to move between nodes
    shutil.rmtree(tmp_path / "sys/devices/system/node/node1")
    host.set_numa([(3 * GIB, 64 * GIB, LOW)])
    loop.cycle(0.0)
    assert loop.interval() == 60.0
    slower = dataclasses.replace(cfg, numa_balance=dataclasses.replace(cfg.numa_balance,
                                                                       interval_s=90.0))
    assert loop_of(slower, state, sysfs, sink, None).interval() == 90.0
    slow_one = loop_of(slower, state, sysfs, sink, None)
    slow_one.cycle(0.0)
    assert slow_one.interval() == 90.0
    # a second node brought online: every second again from the next cycle
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    loop.cycle(60.0)
    assert loop.interval() == 1.0
    # switched off on v2, the loop keeps its period, so that a reload resumes it at once
    off = dataclasses.replace(cfg, numa_balance=dataclasses.replace(cfg.numa_balance,
                                                                    enabled=False))
    idle = loop_of(off, state, sysfs, sink, None)
    idle.cycle(0.0)
    assert idle.interval() == 1.0
    # cgroup v1 has no balance at all
    _, _, _, cfg1, sysfs1, sink1, state1 = setup(tmp_path / "v1", version=1)
    v1 = loop_of(cfg1, state1, sysfs1, sink1, None)
    v1.cycle(0.0)
    assert v1.interval() == 60.0


def test_with_balancing_the_binding_only_adds_nodes(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    (host.cg("cpuset", offline.containers[0].rel) / "cpuset.mems").write_text("0-1\n")
    binding = NumaBindingLoop(lambda: cfg, state, sysfs, layout_for(sysfs), AuditLog(sink))
    binding.cycle(0.0)  # node 0 under its watermark: without balancing this would be "1"
    assert mems(host, offline) == "0-1"
    off = dataclasses.replace(cfg, numa_balance=dataclasses.replace(cfg.numa_balance,
                                                                    enabled=False))
    NumaBindingLoop(lambda: off, state, sysfs, layout_for(sysfs), AuditLog(sink)).cycle(0.0)
    assert mems(host, offline) == "1"


def test_switched_off_the_balance_writes_back_what_it_changed(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    notes = StateFile(str(tmp_path / "state.json"))
    loop = loop_of(cfg, state, sysfs, sink, FakeMover(stat_of(host, offline)), notes)
    loop.cycle(0.0)
    assert mems(host, offline) == "0-1"
    # the binding finds the note and leaves the undo to the balance
    binding = NumaBindingLoop(lambda: cfg, state, sysfs, layout_for(sysfs), AuditLog(sink),
                              notes=notes)
    binding.cycle(1.0)
    assert notes.entries(NUMA_NOTES) == {}
    cfg_off = dataclasses.replace(cfg, numa_balance=dataclasses.replace(cfg.numa_balance,
                                                                        enabled=False))
    off = NumaBalanceLoop(lambda: cfg_off, state, sysfs, layout_for(sysfs), AuditLog(sink),
                          notes=notes)
    off.cycle(2.0)
    assert mems(host, offline) == "0"
    assert notes.entries(NUMA_BALANCE_NOTES) == {}


def test_switched_to_observe_the_balance_writes_back_what_it_changed(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    observing = [False]
    notes = StateFile(str(tmp_path / "state.json"))
    loop = loop_of(cfg, state, sysfs.observing(lambda: observing[0]), sink,
                   FakeMover(stat_of(host, offline)), notes)
    loop.cycle(0.0)
    assert mems(host, offline) == "0-1"
    observing[0] = True  # as the binding's: given back, and only audited from then on
    loop.cycle(1.0)
    assert mems(host, offline) == "0"
    assert set(notes.entries(NUMA_BALANCE_NOTES).values()) <= {"0"}
    assert sink.named("write_observed")


def test_a_pod_no_longer_reclaimed_gets_its_nodes_back(tmp_path: Path) -> None:
    host, _, online, cfg, sysfs, sink, state = setup(tmp_path)
    state.apply_meta(api_pod(WEB, online.info.name, {LEVEL: "reclaimed_cores"}))
    notes = StateFile(str(tmp_path / "state.json"))
    loop = loop_of(cfg, state, sysfs, sink, FakeMover(stat_of(host, online)), notes)
    loop.cycle(0.0)  # the largest reclaimed pod first: widened, one step moved
    assert mems(host, online) == "0-1"
    state.apply_meta(api_pod(WEB, online.info.name, {}))  # shared_cores again
    loop.cycle(1.0)
    assert mems(host, online) == "0"
    path = f"/sys/fs/cgroup/{online.containers[0].rel}/cpuset.mems"
    assert path not in notes.entries(NUMA_BALANCE_NOTES)


def test_a_file_the_binding_noted_first_stays_the_bindings_to_undo(tmp_path: Path) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    notes = StateFile(str(tmp_path / "state.json"))
    NumaBindingLoop(lambda: cfg, state, sysfs, layout_for(sysfs), AuditLog(sink),
                    notes=notes).cycle(0.0)
    assert mems(host, offline) == "0-1"
    path = f"/sys/fs/cgroup/{offline.containers[0].rel}/cpuset.mems"
    assert notes.entries(NUMA_NOTES) == {path: "0"}
    host.set_numa([(3 * GIB, 64 * GIB, LOW), (20 * GIB, 64 * GIB, LOW)])
    (host.cg("cpuset", offline.containers[0].rel) / "cpuset.mems").write_text("0\n")
    loop_of(cfg, state, sysfs, sink, FakeMover(stat_of(host, offline)), notes).cycle(1.0)
    assert mems(host, offline) == "0-1"
    assert notes.entries(NUMA_BALANCE_NOTES) == {}
    assert notes.entries(NUMA_NOTES) == {path: "0"}


class StuckMover(FakeMover):
    """move_pages saying it moved what it was asked while ``memory.numa_stat`` does not move:
    what a guest showed for the last 48 KiB of a pod, step after step."""

    def __call__(self, pids: Sequence[int], hot: int, cool: int, budget: int,
                 timeout_s: float) -> tuple[Outcome, int, str]:
        self.calls.append((list(pids), hot, cool, budget, timeout_s))
        return Outcome.WRITTEN, budget, ""


@pytest.mark.parametrize(("left", "narrowed"), [
    (RESIDUE_BYTES, True),  # at most this much left: the node is taken out
    (RESIDUE_BYTES + 4096, False),  # a page more: another step
])
def test_a_residue_that_does_not_move_ends_the_balance_of_a_container(
        tmp_path: Path, left: int, narrowed: bool) -> None:
    host, offline, _, cfg, sysfs, sink, state = setup(tmp_path)
    write_stat(stat_of(host, offline), {0: left, 1: 200 * MIB})
    (host.cg("cpuset", offline.containers[0].rel) / "cpuset.mems").write_text("0-1\n")
    loop = loop_of(cfg, state, sysfs, sink, StuckMover(stat_of(host, offline)),
                   StateFile(str(tmp_path / "state.json")))
    loop.cycle(0.0)
    assert mems(host, offline) == ("1" if narrowed else "0-1")
