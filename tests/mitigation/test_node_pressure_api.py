"""The taint rung and the node condition against the fake API server, with the real client."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.detection.signals import NODE, Board, Level, Reading
from reconciler.host.statefile import state_file
from reconciler.kube import (
    NODE_UPDATE_ATTEMPTS,
    KubeActions,
    KubernetesConfig,
    NodeOutcome,
    build_api_client,
)
from reconciler.metrics import ReconcilerMetrics
from reconciler.mitigation.actions import Cause, TaintAction
from reconciler.mitigation.service import Mitigation
from tests.support.fake_apiserver import FakeApiServer, write_kubeconfig
from tests.support.polling import eventually

BOUND_S = 10.0
TAINT_GAUGE = "nri_qos_node_taint"
LEVEL_GAUGE = "nri_qos_mitigation_ladder_level"
KIND = "NriQosMemoryPressure"
KUBELET = [{"type": "Ready", "status": "True", "reason": "KubeletReady",
            "lastTransitionTime": "2026-01-01T00:00:00Z"},
           {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}]


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.add_node("node-a")
        server.set_conditions("node-a", KUBELET)
        yield server


@pytest.fixture
def kube(tmp_path: Path, fake: FakeApiServer) -> Iterator[tuple[KubeActions, MemoryAuditSink]]:
    cfg = KubernetesConfig(kubeconfig=str(write_kubeconfig(tmp_path / "kc", fake.url)),
                           request_timeout_s=5.0)
    client = build_api_client(cfg)
    assert client is not None
    sink = MemoryAuditSink()
    yield KubeActions(client, cfg, AuditLog(sink)), sink
    client.close()


def condition(fake: FakeApiServer) -> dict[str, Any] | None:
    return fake.conditions("node-a").get(KIND)


def status_patches(fake: FakeApiServer) -> int:
    return len(fake.requests("PATCH", "/api/v1/nodes/node-a/status"))


async def test_condition_set_once_then_flipped_keeping_kubelets(
        fake: FakeApiServer, kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, _ = kube
    assert await actions.set_node_condition("node-a", KIND, True, "MemoryInterference",
                                            "psi 40 %") is NodeOutcome.CHANGED
    found = condition(fake)
    assert found is not None
    assert (found["status"], found["reason"], found["message"]) == (
        "True", "MemoryInterference", "psi 40 %")
    assert fake.condition_types("node-a") == ["Ready", "MemoryPressure", KIND]
    # the same status and reason again: nothing written, even with another message
    assert await actions.set_node_condition("node-a", KIND, True, "MemoryInterference",
                                            "psi 50 %") is NodeOutcome.UNCHANGED
    assert status_patches(fake) == 1
    first_transition = found["lastTransitionTime"]
    await asyncio.sleep(1.05)  # the API's times have whole seconds
    assert await actions.set_node_condition("node-a", KIND, False, "NoMemoryInterference",
                                            "calm") is NodeOutcome.CHANGED
    flipped = condition(fake)
    assert flipped is not None
    assert flipped["status"] == "False"
    assert flipped["lastTransitionTime"] != first_transition
    assert [fake.conditions("node-a")[c["type"]] for c in KUBELET] == KUBELET


async def test_condition_conflicts_are_retried(
        fake: FakeApiServer, kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, _ = kube
    fake.conflict_next_patches(2)
    assert await actions.set_node_condition("node-a", KIND, True, "R", "m") is (
        NodeOutcome.CHANGED)
    assert [r.status for r in fake.requests("PATCH", "/api/v1/nodes/node-a/status")] == [
        409, 409, 200]
    fake.conflict_next_patches(NODE_UPDATE_ATTEMPTS)
    assert await actions.set_node_condition("node-a", KIND, False, "R2", "m") is (
        NodeOutcome.FAILED)
    assert condition(fake)["status"] == "True"  # type: ignore[index]


async def test_condition_without_api_or_node(kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, _ = kube
    assert await actions.set_node_condition("nowhere", KIND, True, "R", "m") is (
        NodeOutcome.FAILED)
    offline = KubeActions(None, KubernetesConfig(), AuditLog(MemoryAuditSink()))
    assert await offline.set_node_condition("node-a", KIND, True, "R", "m") is (
        NodeOutcome.UNAVAILABLE)


async def test_taint_action_without_api_is_skipped() -> None:
    audit = AuditLog(MemoryAuditSink())
    action = TaintAction(Config, KubeActions(None, KubernetesConfig(), audit), "node-a", audit)
    assert (await action.engage(Cause(Level.LOW), False)).detail == "no Kubernetes API access"
    assert (await action.release(Cause(Level.LOW), False)).result == "skipped"
    assert (await action.engage(Cause(Level.LOW), True)).result == "dry_run"
    assert action.placed() == []


async def test_taint_action_fails_when_the_api_refuses(
        fake: FakeApiServer, kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, audit = kube
    # a node the API does not know: every read of it is refused (404)
    action = TaintAction(Config, actions, "nowhere", AuditLog(MemoryAuditSink()))
    engaged = await action.engage(Cause(Level.LOW), False)
    assert (engaged.result, engaged.detail) == (
        "failed", "taint nri-qos.io/memory-pressure:NoSchedule, NriQosMemoryPressure=True: the "
        "API refused or did not answer (see the log)")
    assert action.placed() == []
    released = await action.release(Cause(Level.NONE), False)
    assert (released.result, released.detail) == (
        "failed", "remove taint nri-qos.io/memory-pressure, NriQosMemoryPressure=False: the "
        "API refused or did not answer (see the log)")
    assert audit.named("taint_added") == audit.named("taint_removed") == []
    assert fake.taints("node-a") == []


class Ladder:
    def __init__(self, kube: KubeActions, cooldown_s: float, **mitigation: Any) -> None:
        cfg = Config()
        self.cfg = dataclasses.replace(cfg, mitigation=dataclasses.replace(
            cfg.mitigation, cooldown_s=cooldown_s, **mitigation))
        self.board = Board()
        self.sink = MemoryAuditSink()
        self.metrics = ReconcilerMetrics()
        action = TaintAction(lambda: self.cfg, kube, "node-a", AuditLog(self.sink), self.metrics)
        self.mitigation = Mitigation(lambda: self.cfg, self.board, {"taint": action},
                                     AuditLog(self.sink), metrics=self.metrics,
                                     taints=action.placed)
        self.stop = asyncio.Event()

    def gauge(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels or {})

    def pressure(self, level: Level, value: float) -> None:
        self.board.publish("psi", [Reading("psi", NODE, level, value, 10.0, "percent", "x")])

    async def until(self, check: Callable[[], bool]) -> None:
        await eventually(check, BOUND_S)


async def test_the_ladder_taints_once_and_removes_after_the_cooldown(
        fake: FakeApiServer, kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, audit = kube
    ladder = Ladder(actions, cooldown_s=0.5)
    task = asyncio.create_task(ladder.mitigation.run(ladder.stop))
    try:
        # the start clears leftovers: no taint to remove, the condition written False once
        await ladder.until(lambda: len(ladder.sink.named("mitigation_action")) == 1)
        assert condition(fake)["status"] == "False"  # type: ignore[index]
        fake.conflict_next_patches(1)  # someone updates the node right before our patch
        ladder.pressure(Level.LOW, 20.0)
        await ladder.until(lambda: len(ladder.sink.named("mitigation_action")) == 2)
        assert fake.taints("node-a") == [{"key": "nri-qos.io/memory-pressure",
                                          "effect": "NoSchedule"}]
        assert condition(fake)["status"] == "True"  # type: ignore[index]
        assert [r.status for r in fake.requests("PATCH", "/api/v1/nodes/node-a")] == [409, 200]
        (placed,) = ladder.mitigation.taints()
        assert (placed.key, placed.value, placed.effect) == (
            "nri-qos.io/memory-pressure", "", "NoSchedule")
        assert ladder.gauge(TAINT_GAUGE, {"taint": placed.key}) == 1.0
        assert ladder.gauge(LEVEL_GAUGE) == 1.0
        patches = len(fake.requests("PATCH"))
        # more pressure, another value, a higher level: the taint rung is engaged already
        ladder.pressure(Level.MEDIUM, 35.0)
        ladder.pressure(Level.LOW, 25.0)
        await asyncio.sleep(0.3)
        assert len(fake.requests("PATCH")) == patches
        assert len(audit.named("taint_added")) == 1
        assert ladder.mitigation.taints() == [placed]  # the same taint, since the first add
        # calm: the taint goes after the cooldown, the condition turns False
        ladder.pressure(Level.NONE, 1.0)
        await ladder.until(lambda: len(ladder.sink.named("mitigation_action")) == 3)
        assert fake.taints("node-a") == []
        assert condition(fake)["status"] == "False"  # type: ignore[index]
        assert ladder.mitigation.taints() == []
        assert ladder.gauge(TAINT_GAUGE, {"taint": placed.key}) == 0.0
        assert ladder.gauge(LEVEL_GAUGE) == 0.0
        [removed] = audit.named("taint_removed")
        assert removed["taint"] == "nri-qos.io/memory-pressure:NoSchedule"
        results = [(r["step"], r["result"]) for r in ladder.sink.named("mitigation_action")]
        assert results == [("release", "done"), ("engage", "done"), ("release", "done")]
        assert [r["status"] for r in ladder.sink.named("node_condition")] == [
            "False", "True", "False"]
    finally:
        ladder.stop.set()
        await asyncio.wait_for(task, BOUND_S)


TAINT_KEY = "nri-qos.io/memory-pressure"


async def test_a_refused_release_is_retried_until_the_taint_is_gone(
        fake: FakeApiServer, kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, _ = kube
    ladder = Ladder(actions, cooldown_s=0.2, retry_initial_s=0.1, retry_max_s=0.2)
    task = asyncio.create_task(ladder.mitigation.run(ladder.stop))
    try:
        await ladder.until(lambda: len(ladder.sink.named("mitigation_action")) == 1)
        ladder.pressure(Level.LOW, 20.0)
        await ladder.until(lambda: len(ladder.sink.named("mitigation_action")) == 2)
        assert fake.taints("node-a") != []
        # The API server is away for a while: every write to the node fails.
        fake.fail_next("GET", "/api/v1/nodes/node-a", 503, count=4)
        ladder.pressure(Level.NONE, 1.0)
        await ladder.until(lambda: len([
            r for r in ladder.sink.named("mitigation_action")
            if (r["step"], r["result"]) == ("release", "failed")]) >= 2)
        assert ladder.mitigation.state().engaged == ()
        # Back: the taint goes without any new pressure or calm.
        await ladder.until(lambda: fake.taints("node-a") == [])
        await ladder.until(lambda: condition(fake)["status"] == "False")  # type: ignore[index]
        assert ladder.mitigation.taints() == []
    finally:
        ladder.stop.set()
        await asyncio.wait_for(task, BOUND_S)


async def test_release_removes_the_key_placed_when_the_key_changed_while_engaged(
        fake: FakeApiServer, kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, _ = kube
    ladder = Ladder(actions, cooldown_s=0.2)
    task = asyncio.create_task(ladder.mitigation.run(ladder.stop))
    try:
        await reload_while_tainted(ladder, fake, key="example.com/busy")
        await ladder.until(lambda: fake.taints("node-a") == [])
    finally:
        ladder.stop.set()
        await asyncio.wait_for(task, BOUND_S)


async def reload_while_tainted(ladder: Ladder, fake: FakeApiServer, **taint: Any) -> None:
    """Presses until the ladder has tainted the node, reloads the taint rung with ``taint``
    changed, and lets the pressure go."""
    await ladder.until(lambda: len(ladder.sink.named("mitigation_action")) == 1)
    ladder.pressure(Level.LOW, 20.0)
    await ladder.until(lambda: fake.taints("node-a") != [])
    m = ladder.cfg.mitigation
    ladder.cfg = dataclasses.replace(ladder.cfg, mitigation=dataclasses.replace(
        m, taint=dataclasses.replace(m.taint, **taint)))
    ladder.pressure(Level.NONE, 1.0)


async def test_the_start_clears_a_taint_left_even_when_the_rung_is_now_off(
        fake: FakeApiServer, kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, _ = kube
    fake.add_node("node-a", taints=[{"key": TAINT_KEY, "effect": "NoSchedule"}],
                  conditions=[*KUBELET, {"type": KIND, "status": "True"}])
    cfg = Config()
    ladder = Ladder(actions, cooldown_s=0.2, taint=dataclasses.replace(
        cfg.mitigation.taint, enabled=False))
    task = asyncio.create_task(ladder.mitigation.run(ladder.stop))
    try:
        await ladder.until(lambda: fake.taints("node-a") == [])
        await ladder.until(lambda: condition(fake)["status"] == "False")  # type: ignore[index]
    finally:
        ladder.stop.set()
        await asyncio.wait_for(task, BOUND_S)


async def test_a_restart_removes_the_taint_an_earlier_run_placed_under_another_key(
        tmp_path: Path, fake: FakeApiServer, kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, _ = kube
    path = str(tmp_path / "state")
    cfg = Config()
    old = dataclasses.replace(cfg, mitigation=dataclasses.replace(
        cfg.mitigation, taint=dataclasses.replace(cfg.mitigation.taint, key="example.com/old",
                                                  condition="OldPressure")))
    audit = AuditLog(MemoryAuditSink())
    first = TaintAction(lambda: old, actions, "node-a", audit, notes=state_file(path))
    assert (await first.engage(Cause(Level.LOW), False)).result == "done"
    assert [t["key"] for t in fake.taints("node-a")] == ["example.com/old"]
    # The next run has another key configured, and the rung switched off.
    second = TaintAction(Config, actions, "node-a", audit, notes=state_file(path))
    released = await second.release(Cause(Level.NONE), False)
    assert released.result == "done"
    assert released.detail.startswith("remove taint example.com/old, " + TAINT_KEY)
    assert fake.taints("node-a") == []
    assert fake.conditions("node-a")["OldPressure"]["status"] == "False"
    assert state_file(path).entries("taint") == {}


async def test_a_release_in_dry_run_removes_the_taint_this_agent_placed(
        tmp_path: Path, fake: FakeApiServer, kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, audit = kube
    notes = state_file(str(tmp_path / "state"))
    action = TaintAction(Config, actions, "node-a", AuditLog(MemoryAuditSink()), notes=notes)
    assert (await action.engage(Cause(Level.LOW), False)).result == "done"
    # A reload put the rung in dry run (or the node in observe mode): undoing is not held back.
    released = await action.release(Cause(Level.NONE), True)
    assert (released.result, released.detail) == (
        "done", f"remove taint {TAINT_KEY}, {KIND}=False (placed by this agent: undone in dry "
                "run too)")
    assert fake.taints("node-a") == []
    assert condition(fake)["status"] == "False"  # type: ignore[index]
    assert [r["taint"] for r in audit.named("taint_removed")] == [f"{TAINT_KEY}:NoSchedule"]
    assert action.placed() == []
    assert notes.entries("taint") == notes.entries("node_condition") == {}
    # Nothing of ours is left: the next one writes nothing.
    requests = len(fake.requests())
    again = await action.release(Cause(Level.NONE), True)
    assert (again.result, again.detail) == (
        "dry_run", f"would remove taint {TAINT_KEY}, {KIND}=False")
    assert len(fake.requests()) == requests


async def test_a_release_in_dry_run_leaves_a_taint_this_agent_did_not_place(
        tmp_path: Path, fake: FakeApiServer, kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, audit = kube
    fake.add_node("node-a", taints=[{"key": TAINT_KEY, "effect": "NoSchedule"}],
                  conditions=[*KUBELET, {"type": KIND, "status": "True"}])
    action = TaintAction(Config, actions, "node-a", AuditLog(MemoryAuditSink()),
                         notes=state_file(str(tmp_path / "state")))
    requests = len(fake.requests())
    released = await action.release(Cause(Level.NONE), True)
    assert (released.result, released.detail) == (
        "dry_run", f"would remove taint {TAINT_KEY}, {KIND}=False")
    assert len(fake.requests()) == requests
    assert fake.taints("node-a") == [{"key": TAINT_KEY, "effect": "NoSchedule"}]
    assert condition(fake)["status"] == "True"  # type: ignore[index]
    assert audit.named("taint_removed") == []


async def test_the_ladder_removes_its_taint_after_a_reload_to_dry_run(
        fake: FakeApiServer, kube: tuple[KubeActions, MemoryAuditSink]) -> None:
    actions, _ = kube
    ladder = Ladder(actions, cooldown_s=0.2)
    task = asyncio.create_task(ladder.mitigation.run(ladder.stop))
    try:
        await reload_while_tainted(ladder, fake, dry_run=True)
        await ladder.until(lambda: fake.taints("node-a") == [])
        await ladder.until(lambda: condition(fake)["status"] == "False")  # type: ignore[index]
        await ladder.until(lambda: ladder.mitigation.state().engaged == ())
        await ladder.until(lambda: ladder.mitigation.state().releasing == ())
        steps = [(r["step"], r["result"], r["dry_run"])
                 for r in ladder.sink.named("mitigation_action")]
        assert ("release", "done", True) in steps[2:]
    finally:
        ladder.stop.set()
        await asyncio.wait_for(task, BOUND_S)
