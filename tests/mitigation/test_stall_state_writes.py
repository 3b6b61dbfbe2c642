"""The notes the event loop writes to the state file (the taint rung's, the eviction manager's
node conditions, the leftovers an agent with the reconciler off takes off the node) do not stall
the loop when the disk is slow, as under the heavy writeback of memory pressure: the loop serves
every NRI answer, and containerd drops a plugin that does not answer within 2 s. Each note is
still on disk before the effect it records is made on the node, and goes only after the effect
is undone. Real client, fake API server; the disk's fsync made slow."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.agent import _leftovers
from nri_plugin.config.schema import Config
from nri_plugin.config.store import ConfigStore
from reconciler.detection.signals import Level
from reconciler.eviction.api import Condition, MetType, ThresholdMet
from reconciler.eviction.conditions import EVICTION_CONDITION_NOTES
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.statefile import state_file
from reconciler.host.sysfs import SysFs
from reconciler.kube import KubeActions, KubernetesConfig, build_api_client
from reconciler.mitigation.actions import CONDITION_NOTES, DONE, TAINT_NOTES, Cause, TaintAction
from tests.support.eviction_env import NODE, make_env
from tests.support.fake_apiserver import FakeApiServer, write_kubeconfig

SLOW_S = 1.0
"""One fsync of the state file, as under heavy writeback."""
LATE_S = 0.3
"""How late a 10 ms sleep on the loop may wake: far above a turn of the loop on a busy 2-CPU
machine, far below a write of the state file."""
KEY = "nri-qos.io/memory-pressure"
RUNG_CONDITION = "NriQosMemoryPressure"
PLUGINS_OWN = "ExampleVendorPressure"

_T = TypeVar("_T")
Node = tuple[list[str], dict[str, str]]
"""The node as the API has it: its taint keys, and its conditions' statuses by type."""


class SlowDisk:
    """``os.fsync`` taking :data:`SLOW_S`; what the node was at each write is kept."""

    def __init__(self, fake: FakeApiServer) -> None:
        self._fake = fake
        self._fsync = os.fsync
        self.seen: list[Node] = []

    def __call__(self, fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            self._fsync(fd)  # the rename's, after the file's own: one write, seen once
            return
        self.seen.append(node(self._fake))
        time.sleep(SLOW_S)
        self._fsync(fd)


def node(fake: FakeApiServer) -> Node:
    return ([t["key"] for t in fake.taints(NODE)],
            {kind: c["status"] for kind, c in fake.conditions(NODE).items()})


async def lateness_while(work: Coroutine[Any, Any, _T]) -> tuple[_T, float]:
    """``work``'s result, and how late at worst a 10 ms sleep on the loop woke meanwhile."""
    loop = asyncio.get_running_loop()
    worst = 0.0

    async def probe() -> None:
        nonlocal worst
        while True:
            start = loop.time()
            await asyncio.sleep(0.01)
            worst = max(worst, loop.time() - start - 0.01)

    task = asyncio.create_task(probe())
    await asyncio.sleep(0.05)  # the probe sleeps before the work begins
    try:
        result = await work
    finally:
        task.cancel()
    return result, worst


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.add_node(NODE, conditions=[{"type": "Ready", "status": "True"}])
        yield server


@pytest.fixture
def writer() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nri-qos-state")
    yield pool
    pool.shutdown()


def slow_disk(fake: FakeApiServer, monkeypatch: pytest.MonkeyPatch) -> SlowDisk:
    disk = SlowDisk(fake)
    monkeypatch.setattr(os, "fsync", disk)  # what the state file calls
    return disk


def kube_config(tmp_path: Path, fake: FakeApiServer) -> KubernetesConfig:
    return KubernetesConfig(kubeconfig=str(write_kubeconfig(tmp_path / "kc", fake.url)),
                            node_name=NODE, request_timeout_s=5.0)


async def test_the_taint_rungs_notes_on_a_slow_disk_do_not_stall_the_event_loop(
        tmp_path: Path, fake: FakeApiServer, writer: ThreadPoolExecutor,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = kube_config(tmp_path, fake)
    client = build_api_client(cfg)
    assert client is not None
    audit = AuditLog(MemoryAuditSink())
    notes = state_file(str(tmp_path / "state"), writer=writer)
    action = TaintAction(Config, KubeActions(client, cfg, audit), NODE, audit, notes=notes)
    disk = slow_disk(fake, monkeypatch)
    try:
        engaged, late = await lateness_while(action.engage(Cause(Level.LOW), False))
        assert engaged.result == DONE
        assert late < LATE_S
        # Each note was on disk before its effect was on the node.
        assert disk.seen == [([], {"Ready": "True"}), ([KEY], {"Ready": "True"})]
        on_disk = state_file(str(tmp_path / "state"))
        assert on_disk.entries(TAINT_NOTES) == {KEY: "NoSchedule"}
        assert on_disk.entries(CONDITION_NOTES) == {RUNG_CONDITION: "True"}
        disk.seen.clear()
        released, late = await lateness_while(action.release(Cause(Level.NONE), False))
        assert released.result == DONE
        assert late < LATE_S
        # Each note went once its effect was undone.
        assert disk.seen == [([], {"Ready": "True", RUNG_CONDITION: "True"}),
                             ([], {"Ready": "True", RUNG_CONDITION: "False"})]
        on_disk = state_file(str(tmp_path / "state"))
        assert on_disk.entries(TAINT_NOTES) == on_disk.entries(CONDITION_NOTES) == {}
    finally:
        client.close()


async def test_an_eviction_condition_noted_on_a_slow_disk_does_not_stall_the_event_loop(
        tmp_path: Path, fake: FakeApiServer, writer: ThreadPoolExecutor,
        monkeypatch: pytest.MonkeyPatch) -> None:
    env = make_env(tmp_path, fake, notes=state_file(str(tmp_path / "state"), writer=writer))
    env.system.threshold = ThresholdMet(MetType.SOFT_MET,
                                        condition=Condition(PLUGINS_OWN, True))
    disk = slow_disk(fake, monkeypatch)
    _, late = await lateness_while(env.round())
    assert fake.conditions(NODE)[PLUGINS_OWN]["status"] == "True"
    assert late < LATE_S
    assert disk.seen == [([], {"Ready": "True"})]  # noted before it was written
    assert state_file(str(tmp_path / "state")).entries(EVICTION_CONDITION_NOTES) == {
        PLUGINS_OWN: "system_pressure"}


async def test_leftovers_taken_off_with_a_slow_disk_do_not_stall_the_event_loop(
        tmp_path: Path, fake: FakeApiServer, writer: ThreadPoolExecutor,
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake.add_node(NODE, taints=[{"key": KEY, "value": "true", "effect": "NoSchedule"}],
                  conditions=[{"type": "Ready", "status": "True"},
                              {"type": RUNG_CONDITION, "status": "True"}])
    earlier = state_file(str(tmp_path / "state"))
    earlier.put(TAINT_NOTES, KEY, "NoSchedule")
    earlier.put(CONDITION_NOTES, RUNG_CONDITION, "True")
    cfg = Config()
    cfg = dataclasses.replace(cfg, kubernetes=kube_config(tmp_path, fake),
                              reconciler=dataclasses.replace(
                                  cfg.reconciler, enabled=False, root=str(tmp_path / "host"),
                                  state_dir=str(tmp_path / "state")))
    audit = AuditLog(MemoryAuditSink())
    leftovers = _leftovers(ConfigStore(audit, config=cfg), SysFs(cfg.reconciler.root, audit),
                           audit, state_file(cfg.reconciler.state_dir, writer=writer),
                           CgroupLayout(1, "cgroupfs"))
    disk = slow_disk(fake, monkeypatch)
    _, late = await lateness_while(asyncio.wait_for(leftovers(asyncio.Event()), 10.0))
    assert node(fake) == ([], {"Ready": "True", RUNG_CONDITION: "False"})
    assert late < LATE_S
    assert len(disk.seen) == 2
    on_disk = state_file(str(tmp_path / "state"))
    assert on_disk.entries(TAINT_NOTES) == on_disk.entries(CONDITION_NOTES) == {}

