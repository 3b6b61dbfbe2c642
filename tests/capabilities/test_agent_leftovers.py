"""An agent started with the reconciler off takes off the node what an earlier run left there
through the API: its taint and condition, retried until the API confirms, and the in-tree
eviction plugins' conditions, as the eviction manager does at a start with it off. The agent as
the daemon builds it, on a fake host, against the fake API server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nri_plugin.agent import Agent
from reconciler.eviction.builtin import NUMA_CONDITION, SYSTEM_CONDITION
from reconciler.host.statefile import state_file
from reconciler.mitigation.actions import CONDITION_NOTES, TAINT_NOTES
from tests.support.fake_apiserver import FakeApiServer
from tests.support.polling import eventually
from tests.support.reconciler_off_agent import agent_with_the_reconciler_off

BOUND_S = 10.0
NODE = "node-a"
KEY = "nri-qos.io/memory-pressure"
RUNG_CONDITION = "NriQosMemoryPressure"
KUBELET = {"type": "Ready", "status": "True", "reason": "KubeletReady",
           "lastTransitionTime": "2026-01-01T00:00:00Z"}


def condition(kind: str, status: str = "True") -> dict[str, str]:
    return {"type": kind, "status": status, "reason": "NriQosThresholdMet",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


def reconciler_off(tmp_path: Path, fake: FakeApiServer) -> Agent:
    return agent_with_the_reconciler_off(
        tmp_path, fake, NODE, request_timeout_s=2.0,
        sections="[mitigation]\nretry_initial_s = 0.1\nretry_max_s = 0.2\n"
                 "[eviction]\nretry_initial_s = 0.1\nretry_max_s = 0.2\n")


async def run_leftovers(agent: Agent, until: Callable[[], bool]) -> None:
    """The one background service of an agent with the reconciler off, until ``until`` holds
    (or its own end); then stopped."""
    (leftovers,) = agent.services[1:]
    stop = asyncio.Event()
    task = asyncio.create_task(leftovers(stop))
    try:
        with contextlib.suppress(TimeoutError):
            await eventually(lambda: until() or task.done(), BOUND_S)
    finally:
        stop.set()
        await asyncio.wait_for(task, BOUND_S)
        agent.executor.shutdown()


async def test_a_refused_release_of_an_earlier_runs_taint_is_retried_until_it_is_gone(
        tmp_path: Path, fake: FakeApiServer) -> None:
    fake.add_node(NODE, taints=[{"key": KEY, "value": "", "effect": "NoSchedule"}],
                  conditions=[KUBELET, condition(RUNG_CONDITION)])
    notes = state_file(str(tmp_path / "state"))
    notes.put(TAINT_NOTES, KEY, "NoSchedule")
    notes.put(CONDITION_NOTES, RUNG_CONDITION, "True")
    agent = reconciler_off(tmp_path, fake)
    # The API server is busy as the agent starts: its first reads of the node fail.
    fake.fail_next("GET", f"/api/v1/nodes/{NODE}", 503, count=4)
    await run_leftovers(agent, lambda: fake.taints(NODE) == [])
    assert fake.taints(NODE) == []
    assert fake.conditions(NODE)[RUNG_CONDITION]["status"] == "False"
    reread = state_file(str(tmp_path / "state"))
    assert reread.entries(TAINT_NOTES) == {}
    assert reread.entries(CONDITION_NOTES) == {}


async def test_the_in_tree_eviction_conditions_an_earlier_run_left_are_taken_off(
        tmp_path: Path, fake: FakeApiServer) -> None:
    # An earlier run with the reconciler on: its eviction manager set the node's conditions.
    fake.add_node(NODE, conditions=[KUBELET, condition(SYSTEM_CONDITION),
                                    condition(NUMA_CONDITION, "False")])
    agent = reconciler_off(tmp_path, fake)
    await run_leftovers(agent, lambda: fake.condition_types(NODE) == ["Ready"])
    assert fake.condition_types(NODE) == ["Ready"]
    assert fake.conditions(NODE)["Ready"] == KUBELET


async def test_without_anything_left_the_service_ends_on_its_own(
        tmp_path: Path, fake: FakeApiServer) -> None:
    fake.add_node(NODE, conditions=[KUBELET])
    agent = reconciler_off(tmp_path, fake)
    (leftovers,) = agent.services[1:]
    try:
        await asyncio.wait_for(leftovers(asyncio.Event()), BOUND_S)
    finally:
        agent.executor.shutdown()
    assert fake.condition_types(NODE) == ["Ready"]
    assert fake.requests("PATCH") == []


async def test_retrying_stops_with_the_agent(tmp_path: Path, fake: FakeApiServer) -> None:
    fake.add_node(NODE, taints=[{"key": KEY, "value": "", "effect": "NoSchedule"}])
    state_file(str(tmp_path / "state")).put(TAINT_NOTES, KEY, "NoSchedule")
    agent = reconciler_off(tmp_path, fake)
    fake.fail_next("GET", f"/api/v1/nodes/{NODE}", 503, count=1000)
    (leftovers,) = agent.services[1:]
    stop = asyncio.Event()
    task = asyncio.create_task(leftovers(stop))
    try:
        await eventually(lambda: len(fake.requests("GET")) >= 2, BOUND_S)
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, BOUND_S)
        agent.executor.shutdown()
    assert fake.taints(NODE) != []
    assert state_file(str(tmp_path / "state")).entries(TAINT_NOTES) == {KEY: "NoSchedule"}
