"""The mitigation service: the ladder with actions that succeed, fail, hang, and run in dry-run,
driven by the detectors it is configured with."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.detection.counting import Counting
from reconciler.detection.signals import NODE, Board, Level, Reading, pod_scope
from reconciler.host.probe import HostInfo, probe_host
from reconciler.host.sysfs import SysFs
from reconciler.mitigation.actions import DONE, DRY_RUN, Cause, EvictAction, Result
from reconciler.mitigation.service import Mitigation, counting, counting_on
from tests.support.fakesys import FakeHost
from tests.support.ladder import Running, config, reading


async def test_the_service_escalates_and_releases_with_audit() -> None:
    async with Running(config()) as run:
        run.board.publish("psi", [reading("psi", Level.LOW)])
        assert not run.mitigation.engaged()
        await run.until(lambda: len(run.calls) == 2)
        assert run.calls == [("taint", "engage", False), ("tune", "engage", False)]
        assert run.mitigation.engaged()  # what holds offloading off
        [level] = run.sink.named("mitigation_level")
        assert (level["ladder_level"], level["previous"]) == ("low", "none")
        record = run.sink.named("mitigation_action")[0]
        assert (record["detector"], record["scope"], record["value"], record["threshold"]) == (
            "psi", NODE, 42.0, 10.0)
        assert "psi on node at 42 percent, threshold 10" in record["reason"]
        run.board.publish("psi", [reading("psi", Level.NONE)])
        await run.until(lambda: len(run.calls) == 4)  # released after the 0.2 s cooldown
        assert run.calls[2:] == [("tune", "release", False), ("taint", "release", False)]
        await run.until(lambda: not run.mitigation.engaged())


async def test_dry_run_is_per_rung() -> None:
    cfg = config(taint={"dry_run": True})
    async with Running(cfg) as run:
        run.board.publish("system_free", [reading("system_free", Level.HIGH)])
        await run.until(lambda: len(run.calls) == 4)
        assert run.calls == [("taint", "engage", True), ("tune", "engage", False),
                             ("drop_cache", "engage", False), ("evict", "engage", True)]
        assert [(a, res, dry) for a, _, res, dry in run.actions_audited()] == [
            ("taint", DRY_RUN, True), ("tune", DONE, False), ("drop_cache", DONE, False),
            ("evict", DRY_RUN, True)]


async def test_a_failing_action_is_audited_and_stops_nothing() -> None:
    async with Running(config()) as run:
        run.actions["taint"].fail = OSError(errno.EBUSY, "Device or resource busy")
        run.board.publish("psi", [reading("psi", Level.MEDIUM)])
        await run.until(lambda: len(run.sink.named("mitigation_action")) == 3)
        results = {a: (res, r["detail"]) for (a, _, res, _), r in
                   zip(run.actions_audited(), run.sink.named("mitigation_action"), strict=True)}
        assert results["taint"] == ("failed", "OSError: [Errno 16] Device or resource busy")
        assert results["tune"][0] == results["drop_cache"][0] == DONE


async def test_a_hanging_action_stalls_neither_the_ladder_nor_the_other_rungs() -> None:
    async with Running(config(drop_cache={"repeat_s": 1.0})) as run:
        run.actions["taint"].hanging = True
        run.board.publish("psi", [reading("psi", Level.MEDIUM)])
        await run.until(lambda: ("drop_cache", "repeat", False) in run.calls)
        assert [c for c in run.calls if c[0] == "taint"] == [("taint", "engage", False)]
        # the ladder still de-escalates the other rungs while taint hangs
        run.board.publish("psi", [reading("psi", Level.NONE)])
        await run.until(lambda: ("tune", "release", False) in run.calls)
        assert ("drop_cache", "release", False) in run.calls
        # taint's release waits behind its hung engage; stop cancels both
        assert ("taint", "release", False) not in run.calls
    assert run.task.done()
    assert not run.task.cancelled()


async def test_a_hanging_action_finishes_then_its_latest_step_runs() -> None:
    async with Running(config()) as run:
        run.actions["taint"].hanging = True
        run.board.publish("psi", [reading("psi", Level.LOW)])
        await run.until(lambda: ("tune", "engage", False) in run.calls)
        run.board.publish("psi", [reading("psi", Level.NONE)])
        await run.until(lambda: ("tune", "release", False) in run.calls)
        run.actions["taint"].hanging = False
        run.actions["taint"].hang.set()
        await run.until(lambda: ("taint", "release", False) in run.calls)
        assert [c[1] for c in run.calls if c[0] == "taint"] == ["engage", "release"]


async def test_unknown_holds_the_last_known_level() -> None:
    async with Running(config()) as run:
        run.board.publish("psi", [reading("psi", Level.LOW)])
        await run.until(lambda: len(run.calls) == 2)
        run.board.publish("psi", [reading("psi", Level.UNKNOWN)])
        await asyncio.sleep(0.5)  # well past the 0.2 s cooldown
        assert len(run.calls) == 2  # nothing released: unknown is not "no pressure"
        assert run.mitigation.state().level is Level.LOW
        run.board.publish("psi", [])  # the detector went away: nothing holds the level
        await run.until(lambda: len(run.calls) == 4)


async def test_a_detector_unknown_from_the_start_does_not_block_releases() -> None:
    async with Running(config()) as run:
        run.board.publish("kswapd", [reading("kswapd", Level.UNKNOWN)])
        run.board.publish("psi", [reading("psi", Level.LOW)])
        await run.until(lambda: len(run.calls) == 2)
        run.board.publish("psi", [reading("psi", Level.NONE)])
        await run.until(lambda: len(run.calls) == 4)


async def test_the_cause_is_fresh_pressure_rather_than_a_level_held() -> None:
    async with Running(config()) as run:
        held = dataclasses.replace(reading("psi", Level.LOW), raw=Level.NONE)
        fresh = dataclasses.replace(reading("pressure_level", Level.LOW, "tier:kubepods"),
                                    raw=Level.LOW)
        run.board.publish("psi", [held])
        assert run.mitigation.assess().reading == held
        run.board.publish("pressure_level", [fresh])
        assert run.mitigation.assess().reading == fresh
        # a worse level wins even when only held
        worse = dataclasses.replace(reading("psi", Level.MEDIUM), raw=Level.NONE)
        run.board.publish("psi", [worse])
        assert run.mitigation.assess().reading == worse
        # an unknown reading standing for its last known level is never fresh
        run.board.publish("psi", [reading("psi", Level.UNKNOWN)])
        cause = run.mitigation.assess()
        assert cause.level is Level.MEDIUM
        run.board.publish("pressure_level", [dataclasses.replace(fresh, level=Level.MEDIUM,
                                                                 raw=Level.MEDIUM)])
        found = run.mitigation.assess().reading
        assert found is not None
        assert found.detector == "pressure_level"


def assessed(cfg: Config, memcg_events: bool, *readings: Reading,
             pod_psi: bool = False, pod_refaults: bool = False) -> Level:
    board = Board()
    for r in readings:
        board.publish(r.detector, [r])
    return Mitigation(lambda: cfg, board, {}, AuditLog(MemoryAuditSink()),
                      counted=lambda: counting(cfg, memcg_events, pod_psi, pod_refaults),
                      ).assess().level


def with_node_signals(choice: str, **detection: Any) -> Config:
    cfg = config()
    return dataclasses.replace(
        cfg, mitigation=dataclasses.replace(cfg.mitigation, node_signals=choice),
        detection=dataclasses.replace(cfg.detection, **detection))


@pytest.mark.parametrize(("choice", "memcg_events", "pod_psi", "drives"), [
    ("auto", True, False, False), ("auto", False, False, True), ("auto", False, True, False),
    ("auto", True, True, False), ("on", True, False, True), ("on", False, False, True),
    ("on", False, True, True), ("off", True, False, False), ("off", False, False, False),
    ("off", False, True, False)])
def test_node_signals_drive_the_ladder_where_neither_memcg_events_nor_pod_psi_do(
        choice: str, memcg_events: bool, pod_psi: bool, drives: bool) -> None:
    node = reading("psi", Level.MEDIUM)
    assert assessed(with_node_signals(choice), memcg_events, node, pod_psi=pod_psi) is (
        Level.MEDIUM if drives else Level.NONE)
    # an online pod's own PSI always counts
    pod = reading("psi", Level.LOW, pod_scope("web"))
    assert assessed(with_node_signals(choice), memcg_events, pod, pod_psi=pod_psi) is Level.LOW


@pytest.mark.parametrize(("choice", "pod_refaults", "drives"), [
    ("auto", True, False), ("auto", False, True), ("on", True, True), ("on", False, True),
    ("off", True, False), ("off", False, True)])
def test_memcg_events_drive_the_ladder_only_where_the_pods_refaults_are_not_read(
        choice: str, pod_refaults: bool, drives: bool) -> None:
    """cgroup v1: kubepods' reclaim raises its memcg event whether it takes the online pods'
    pages or the offline tier's; the online pods' refaults tell which."""
    event = reading("pressure_level", Level.MEDIUM, "tier:kubepods")
    assert assessed(with_node_signals(choice), True, event, pod_refaults=pod_refaults) is (
        Level.MEDIUM if drives else Level.NONE)
    # an online pod's refaults always count, and the node-wide readings never with them
    pod = reading("refault", Level.LOW, pod_scope("web"))
    assert assessed(with_node_signals(choice), True, pod,
                    pod_refaults=pod_refaults) is Level.LOW
    node = reading("kswapd", Level.HIGH)
    assert assessed(with_node_signals(choice), True, node, pod_refaults=pod_refaults) is (
        Level.HIGH if choice == "on" else Level.NONE)


def test_memcg_events_drive_when_the_pods_refaults_are_switched_off() -> None:
    event = reading("pressure_level", Level.LOW, "tier:kubepods")
    assert assessed(with_node_signals("auto"), True, event, pod_refaults=True) is Level.NONE
    assert assessed(with_node_signals("auto", disabled=("refault",)), True, event,
                    pod_refaults=True) is Level.LOW
    cfg = with_node_signals("auto")
    cfg = dataclasses.replace(cfg, mitigation=dataclasses.replace(
        cfg.mitigation, detectors=("pressure_level",)))
    assert assessed(cfg, True, event, pod_refaults=True) is Level.LOW


@pytest.mark.parametrize("detector", ["system_free", "numa_free", "kswapd"])
@pytest.mark.parametrize(("memcg_events", "pod_psi", "drives"), [
    (False, False, True), (True, False, False), (False, True, False)])
def test_free_memory_and_kswapd_are_node_signals_too(
        detector: str, memcg_events: bool, pod_psi: bool, drives: bool) -> None:
    scope = "numa:1" if detector == "numa_free" else "node"
    found = reading(detector, Level.MEDIUM, scope)
    assert assessed(with_node_signals("auto"), memcg_events, found, pod_psi=pod_psi) is (
        Level.MEDIUM if drives else Level.NONE)
    assert assessed(with_node_signals("on"), memcg_events, found,
                    pod_psi=pod_psi) is Level.MEDIUM


def test_node_signals_drive_when_the_memcg_events_are_switched_off() -> None:
    node = reading("psi", Level.LOW)
    assert assessed(with_node_signals("auto", disabled=("pressure_level",)), True,
                    node) is Level.LOW
    assert assessed(with_node_signals("auto", enabled=False), True, node) is Level.LOW
    cfg = with_node_signals("auto")
    cfg = dataclasses.replace(cfg, mitigation=dataclasses.replace(
        cfg.mitigation, detectors=("psi", "system_free")))
    assert assessed(cfg, True, node) is Level.LOW


def probed(root: Path, version: int, *, events: bool = False, psi: bool = False,
           refaults: bool = False) -> HostInfo:
    FakeHost(root, version=version, driver="systemd" if version == 2 else "cgroupfs")
    host = probe_host(SysFs(str(root)))
    return dataclasses.replace(
        host, memcg=dataclasses.replace(host.memcg, pressure_level=events, refaults=refaults),
        psi=dataclasses.replace(host.psi, readable=psi))


@pytest.mark.parametrize(("version", "events", "psi", "refaults", "counted"), [
    (1, True, True, True, Counting(memcg=False, node=False)),
    (1, True, True, False, Counting(memcg=True, node=False)),
    (1, False, True, False, Counting(memcg=True, node=True)),
    (2, False, True, True, Counting(memcg=False, node=False)),
    (2, False, False, True, Counting(memcg=False, node=False)),
    (2, False, False, False, Counting(memcg=True, node=True))])
def test_counting_reads_the_host_and_the_config_in_force(
        tmp_path: Path, version: int, events: bool, psi: bool, refaults: bool,
        counted: Counting) -> None:
    """What the ladder and the eviction manager's node-wide plugins are given: the rule on this
    host (v1: the pods' refaults, else the memcg pressure events; v2: the pods' PSI, else their
    refaults), the configuration read each time."""
    cfg = [with_node_signals("auto")]
    ask = counting_on(lambda: cfg[0], probed(tmp_path, version, events=events, psi=psi,
                                              refaults=refaults))
    assert ask() == counted
    cfg[0] = with_node_signals("on")
    assert ask() == Counting(memcg=True, node=True)
    cfg[0] = with_node_signals("off")
    assert ask() == Counting(memcg=counted.memcg, node=False)


def test_node_signals_drive_when_the_pods_psi_is_switched_off() -> None:
    """cgroup v2: the pods' PSI keeps the node's out only while it is read and drives."""
    node = reading("psi", Level.LOW)
    assert assessed(with_node_signals("auto"), False, node, pod_psi=True) is Level.NONE
    assert assessed(with_node_signals("auto", enabled=False), False, node,
                    pod_psi=True) is Level.LOW
    assert assessed(with_node_signals("auto", disabled=("psi",)), False, node,
                    pod_psi=True) is Level.LOW


async def test_only_the_configured_detectors_drive_the_ladder() -> None:
    async with Running(config()) as run:
        run.board.publish("rss_overuse", [reading("rss_overuse", Level.HIGH, pod_scope("u"))])
        run.board.publish("fulfillment", [reading("fulfillment", Level.HIGH, "tier:x")])
        await asyncio.sleep(0.2)
        assert run.calls == []
        assert run.mitigation.state().level is Level.NONE


async def test_state_reports_level_engaged_rungs_and_last_results() -> None:
    async with Running(config(cooldown=60.0)) as run:
        run.board.publish("psi", [reading("psi", Level.LOW)])
        await run.until(lambda: len(run.calls) == 2)
        await run.until(lambda: len(run.mitigation.state().last) == 4)
        state = run.mitigation.state()
        assert state.level is Level.LOW
        assert state.engaged == ("taint", "tune")
        assert state.last["taint"] == ("engage", DONE, "taint engage")
        assert "psi on node" in state.cause


async def test_evict_rung_without_an_evictor() -> None:
    action = EvictAction(None)
    cause = Cause(Level.HIGH)
    assert await action.engage(cause, False) == Result("skipped", "no evictor")
    assert (await action.engage(cause, True)).result == DRY_RUN

    class Manager:
        def __init__(self) -> None:
            self.reasons: list[str] = []

        def request_round(self, reason: str) -> None:
            self.reasons.append(reason)

    manager = Manager()
    assert (await EvictAction(manager).repeat(cause, False)).result == DONE
    assert manager.reasons == [cause.text()]
    assert (await EvictAction(manager).release(cause, False)).result == "unchanged"


@pytest.mark.parametrize("level", [Level.LOW, Level.HIGH])
def test_cause_text_names_the_reading(level: Level) -> None:
    assert Cause(level).text() == f"level {level.name.lower()}: no detector reports pressure"
    text = Cause(level, reading("psi", level)).text()
    assert text.startswith(f"level {level.name.lower()}: psi on node at 42 percent, threshold 10")


def test_cause_text_shows_bytes_whole() -> None:
    free = Reading("system_free", NODE, Level.LOW, 23446401024.0, 2147483648.0, "bytes", "r")
    assert "system_free on node at 21.8 GiB, threshold 2.0 GiB (r)" in Cause(Level.LOW, free).text()
