"""The node conditions the eviction manager keeps: written on change and smoothed, retried after
a refusal, taken back after a switch to dry run, taken off the node when the manager is switched
off, and bounded in number; the real client against the fake API server, an injected clock."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

from reconciler.eviction.api import Condition, MetType, Operator, ThresholdMet
from tests.support.eviction_env import NODE, make_env
from tests.support.fake_apiserver import FakeApiServer


async def test_node_condition_written_on_change_and_smoothed(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake, condition_transition_s=300.0)
    name = "NriQosSystemMemoryPressure"
    met = ThresholdMet(MetType.SOFT_MET, 4.0, 3.0, Operator.LESS_THAN, "node",
                       Condition(name, True), signal="system_free")
    calm = dataclasses.replace(met, met=MetType.NOT_MET, condition=Condition(name, False))
    env.system.threshold = calm
    await env.round()
    assert fake.conditions(NODE)[name]["status"] == "False"
    env.system.threshold = met
    await env.round()
    written = fake.conditions(NODE)[name]
    assert (written["status"], written["reason"]) == ("True", "NriQosThresholdMet")
    assert written["message"] == "system_pressure: system_free node: 3 < 4"
    patches = len(fake.requests("PATCH"))
    await env.round()
    assert len(fake.requests("PATCH")) == patches  # unchanged: nothing written
    env.system.threshold = calm
    env.clock.now += 299.0
    await env.round()
    assert fake.conditions(NODE)[name]["status"] == "True"
    env.clock.now += 1.0
    await env.round()
    assert fake.conditions(NODE)[name]["status"] == "False"
    assert [(c["status"], c["reason"]) for c in env.sink.named("eviction_condition")] == [
        (False, "NriQosThresholdNotMet"), (True, "NriQosThresholdMet"),
        (False, "NriQosThresholdNotMet")]


async def test_a_condition_written_true_is_cleared_after_a_switch_to_dry_run(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    """A condition this agent set True while live is its own to take back: a reload to dry
    run must not leave the node saying it is under pressure for good. A dry-run plugin still
    writes nothing else."""
    env = make_env(tmp_path, fake, condition_transition_s=10.0)
    name = "NriQosSystemMemoryPressure"
    met = ThresholdMet(MetType.SOFT_MET, condition=Condition(name, True))
    env.system.threshold = met
    await env.round()
    assert fake.conditions(NODE)[name]["status"] == "True"
    env.configure(dry_run=True)
    env.system.threshold = dataclasses.replace(met, met=MetType.NOT_MET,
                                               condition=Condition(name, False))
    await env.round()
    assert fake.conditions(NODE)[name]["status"] == "True"  # within the transition period
    env.clock.now += 10.0
    await env.round()
    assert fake.conditions(NODE)[name]["status"] == "False"
    # in dry run, pressure again is audited, not written
    env.system.threshold = met
    await env.round()
    assert fake.conditions(NODE)[name]["status"] == "False"
    assert env.sink.named("eviction_condition")[-1]["status"] is True


async def test_condition_write_failures_retry_with_backoff(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake)
    env.system.threshold = ThresholdMet(MetType.SOFT_MET, condition=Condition("C", True))
    fake.fail_next("PATCH", f"/api/v1/nodes/{NODE}/status", 500, count=2)
    await env.round()
    env.clock.now += 4.9
    await env.round()
    assert len(fake.requests("PATCH")) == 1
    env.clock.now += 0.1
    await env.round()
    assert len(fake.requests("PATCH")) == 2
    env.clock.now += 10
    await env.round()
    assert fake.conditions(NODE)["C"]["status"] == "True"


async def _run_until(done: Callable[[], bool]) -> None:
    for _ in range(300):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached")


async def test_a_disabled_manager_takes_its_conditions_off_the_node(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    """Nobody keeps a condition true to the node once the manager is off: the one it wrote
    this run and an in-tree one an earlier run left go, kubelet's stay; a refused removal is
    tried again after the backoff, never before."""
    env = make_env(tmp_path, fake, interval_s=0.1, quiet_interval_s=0.1)
    ready = {"type": "Ready", "status": "True"}
    left = {"type": "NriQosNumaMemoryPressure", "status": "True"}
    fake.set_conditions(NODE, [ready, left])
    env.system.threshold = ThresholdMet(
        MetType.SOFT_MET, condition=Condition("NriQosSystemMemoryPressure", True))
    await env.round()
    assert fake.conditions(NODE)["NriQosSystemMemoryPressure"]["status"] == "True"
    env.configure(enabled=False)
    written = len(fake.requests("PATCH"))
    fake.fail_next("PATCH", f"/api/v1/nodes/{NODE}/status", 500)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(env.manager.run(stop))
        # the first removal (this run's condition) refused, the earlier run's one done
        await _run_until(lambda: len(fake.requests("PATCH")) == written + 2)
        await asyncio.sleep(0.3)
        # the backoff (retry_initial_s, 5 s of the manager's clock) holds the refused one
        assert fake.condition_types(NODE) == ["Ready", "NriQosSystemMemoryPressure"]
        assert len(fake.requests("PATCH")) == written + 2
        env.clock.now += 5.0
        await _run_until(lambda: fake.condition_types(NODE) == ["Ready"])
        patches = len(fake.requests("PATCH"))
        await asyncio.sleep(0.3)
        assert len(fake.requests("PATCH")) == patches  # once off, nothing more is written
        stop.set()
    assert sorted(env.audited("eviction_condition_removed", "condition")) == [
        "NriQosNumaMemoryPressure", "NriQosSystemMemoryPressure"]


async def test_conditions_kept_at_most_32(tmp_path: Path) -> None:
    env = make_env(tmp_path, None)
    for i in range(40):
        env.system.threshold = ThresholdMet(MetType.SOFT_MET,
                                            condition=Condition(f"Invented{i}", True))
        await env.round()
    names = {c["condition"] for c in env.sink.named("eviction_condition")}
    assert names == {f"Invented{i}" for i in range(32)}
