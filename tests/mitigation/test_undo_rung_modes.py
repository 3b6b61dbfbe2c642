"""A rung engaged while its mode changes under pressure: switched to dry run (or the node to
observe mode) what it placed goes at once, not when the pressure ends; switched back, it acts
again at once."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import ENFORCE, OBSERVE, Config, in_force
from reconciler.detection.pods import PodIndex
from reconciler.detection.signals import NODE, Board, Level, Reading
from reconciler.host.probe import probe_host
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.kube import KubeActions, KubernetesConfig, build_api_client
from reconciler.loops.memory_squeeze import GuardSqueeze
from reconciler.mitigation.actions import Action, TaintAction, TuneAction
from reconciler.mitigation.service import Mitigation
from tests.support.fake_apiserver import FakeApiServer, write_kubeconfig
from tests.support.fakesys import FakeHost
from tests.support.polling import eventually

TAINT_KEY = "nri-qos.io/memory-pressure"
KIND = "NriQosMemoryPressure"
BATCH = "batch-0000-4000-8000-000000000000"
BOUND_S = 10.0
"""A reload reaches the ladder at its next look, at most ``IDLE_RECHECK_S`` (5 s) later."""


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.add_node("node-a")
        yield server


@pytest.fixture
def kube(tmp_path: Path, fake: FakeApiServer) -> Iterator[KubeActions]:
    cfg = KubernetesConfig(kubeconfig=str(write_kubeconfig(tmp_path / "kc", fake.url)),
                           request_timeout_s=5.0)
    client = build_api_client(cfg)
    assert client is not None
    yield KubeActions(client, cfg, AuditLog(MemoryAuditSink()))
    client.close()


def mode(cfg: Config, agent_mode: str) -> Config:
    return dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, mode=agent_mode))


class Ladder:
    """The service with real actions, its configuration read through ``in_force`` as the
    agent reads it, a long cooldown: the level that engaged a rung holds throughout."""

    def __init__(self, actions: Callable[[Callable[[], Config]], dict[str, Action]]) -> None:
        cfg = mode(Config(), ENFORCE)
        self.cfg = dataclasses.replace(cfg, mitigation=dataclasses.replace(
            cfg.mitigation, cooldown_s=3600.0))
        self.board = Board()
        self.sink = MemoryAuditSink()
        self.mitigation = Mitigation(lambda: in_force(self.cfg), self.board,
                                     actions(lambda: in_force(self.cfg)), AuditLog(self.sink))
        self.stop = asyncio.Event()

    def press(self) -> None:
        self.board.publish("psi", [Reading("psi", NODE, Level.LOW, 20.0, 10.0, "percent", "x")])

    def steps(self, action: str) -> list[tuple[str, str, bool]]:
        return [(r["step"], r["result"], r["dry_run"])
                for r in self.sink.named("mitigation_action") if r["action"] == action]


async def test_switched_to_observe_under_pressure_the_taint_goes_and_comes_back_in_enforce(
        fake: FakeApiServer, kube: KubeActions) -> None:
    ladder = Ladder(lambda config: {"taint": TaintAction(config, kube, "node-a",
                                                         AuditLog(MemoryAuditSink()))})
    task = asyncio.create_task(ladder.mitigation.run(ladder.stop))
    try:
        await eventually(lambda: len(ladder.steps("taint")) == 1)  # the start's clearing
        ladder.press()
        await eventually(lambda: fake.taints("node-a") != [])
        ladder.cfg = mode(ladder.cfg, OBSERVE)
        await eventually(lambda: fake.taints("node-a") == [], BOUND_S)
        await eventually(lambda: fake.conditions("node-a")[KIND]["status"] == "False")
        assert ladder.mitigation.state().level is Level.LOW  # the pressure still holds
        await eventually(lambda: ladder.steps("taint")[-1] == ("release", "done", True))
        ladder.cfg = mode(ladder.cfg, ENFORCE)
        await eventually(lambda: fake.taints("node-a") == [{"key": TAINT_KEY,
                                                            "effect": "NoSchedule"}], BOUND_S)
        await eventually(lambda: fake.conditions("node-a")[KIND]["status"] == "True")
        await eventually(lambda: ladder.steps("taint")[-1] == ("engage", "done", False))
    finally:
        ladder.stop.set()
        await asyncio.wait_for(task, 10.0)


async def test_the_tune_rung_switched_to_dry_run_under_pressure_lets_the_tier_go(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2, driver="systemd")
    (host.tier_dir("guaranteed") / "memory.wmark_ratio").write_text("0\n")
    pod = host.add_pod(BATCH, tier="besteffort", name="batch",
                       annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
    wmark = host.cg("memory", host.pod_rel("besteffort", pod.info.uid)) / "memory.wmark_ratio"
    wmark.write_text("95\n")
    sysfs = SysFs(tmp_path, AuditLog(MemoryAuditSink()))
    state = NodeState()
    state.replace_all(*host.nri())
    info = probe_host(sysfs)
    squeeze = GuardSqueeze()
    ladder = Ladder(lambda config: {"tune": TuneAction(
        config, squeeze, sysfs, info, PodIndex(state, info.cgroup), lambda: True,
        StateFile(None))})
    task = asyncio.create_task(ladder.mitigation.run(ladder.stop))
    try:
        ladder.press()
        await eventually(lambda: squeeze.current() is not None)
        assert wmark.read_text() == "80"
        m = ladder.cfg.mitigation
        ladder.cfg = dataclasses.replace(ladder.cfg, mitigation=dataclasses.replace(
            m, tune=dataclasses.replace(m.tune, dry_run=True)))
        await eventually(lambda: squeeze.current() is None, BOUND_S)
        await eventually(lambda: wmark.read_text() == "95")
        assert "tune" in ladder.mitigation.state().engaged  # in dry run, as it would be
        await eventually(lambda: ladder.steps("tune")[-1] == ("release", "done", True))
        ladder.cfg = dataclasses.replace(ladder.cfg, mitigation=m)
        await eventually(lambda: squeeze.current() is not None, BOUND_S)
        assert wmark.read_text() == "80"
    finally:
        ladder.stop.set()
        await asyncio.wait_for(task, 10.0)
