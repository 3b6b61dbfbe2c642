"""Quiet rounds: a round with nothing to act on makes the next one wait ``quiet_interval_s``,
unless a detector's level changes or the ladder asks; anything live keeps the short period."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from reconciler.eviction.api import Condition, MetType, ThresholdMet
from tests.support.eviction_env import Env, forced, make_env
from tests.support.fake_apiserver import FakeApiServer
from tests.support.plugin_process import plugin_process
from tests.support.polling import eventually


async def quiet(env: Env) -> bool:
    return (await env.manager.run_round()).quiet


async def test_a_round_with_nothing_to_act_on_is_quiet(
        tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("batch1", fake=fake)
    assert await quiet(env)


@pytest.mark.parametrize("met", [MetType.SOFT_MET, MetType.HARD_MET])
async def test_a_met_threshold_is_not_quiet(
        tmp_path: Path, fake: FakeApiServer, met: MetType) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("batch1", fake=fake)
    env.system.threshold = ThresholdMet(met)
    assert not await quiet(env)


async def test_a_proposed_pod_is_not_quiet(tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake, dry_run=True)
    env.add_pod("batch1", fake=fake)
    forced(env, "batch1", plugin=env.rss)
    assert not await quiet(env)


async def test_a_plugin_that_did_not_answer_is_not_quiet(
        tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("batch1", fake=fake)
    env.rss.fail = True
    assert not await quiet(env)


async def test_a_true_condition_keeps_rounds_going_until_it_turns_false(
        tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake, condition_transition_s=300.0)
    env.add_pod("batch1", fake=fake)
    env.system.threshold = ThresholdMet(
        MetType.SOFT_MET, condition=Condition("NriQosSystemMemoryPressure", True))
    assert not await quiet(env)
    env.system.threshold = ThresholdMet(MetType.NOT_MET)
    env.clock.now += 299.999
    assert not await quiet(env)  # still true: it turns false after the transition
    env.clock.now += 0.001
    assert await quiet(env)


async def test_a_refused_eviction_waiting_to_be_retried_is_not_quiet(
        tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("batch1", fake=fake)
    fake.fail_next("POST", "/api/v1/namespaces/batch/pods/batch1/eviction", 429)
    forced(env, "batch1")
    assert await env.round() == [("batch/batch1", "blocked")]
    env.system.evict = type(env.system.evict)()  # the plugin no longer asks
    assert not await quiet(env)


async def test_a_refused_eviction_keeps_rounds_going_only_while_it_waits(
        tmp_path: Path, fake: FakeApiServer) -> None:
    """Once its wait is over, the pod is tried again only if a plugin proposes it again, which
    keeps rounds going by itself; the pod left on the node holds nothing."""
    env = make_env(tmp_path, fake)
    env.add_pod("batch1", fake=fake)
    fake.fail_next("POST", "/api/v1/namespaces/batch/pods/batch1/eviction", 429)
    forced(env, "batch1")
    assert await env.round() == [("batch/batch1", "blocked")]
    env.system.evict = type(env.system.evict)()
    env.clock.now += 4.999  # the first backoff is 5 s
    assert not await quiet(env)
    env.clock.now += 0.001
    assert await quiet(env)


async def test_an_out_of_tree_plugin_is_never_quiet(
        tmp_path: Path, fake: FakeApiServer) -> None:
    """It decides from data of its own, which no level change announces."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    env = make_env(tmp_path, fake, plugin_dir=str(plugins))
    env.add_pod("batch1", fake=fake)
    async with plugin_process(plugins / "own.sock", "normal"):
        assert not await quiet(env)
    await env.manager.close()


async def counting_rounds(env: Env, stop: asyncio.Event) -> tuple[asyncio.Task[None],
                                                                   Callable[[], int]]:
    rounds = len(env.system.called("ThresholdMet"))
    task = asyncio.create_task(env.manager.run(stop))
    return task, lambda: len(env.system.called("ThresholdMet")) - rounds


async def test_after_a_quiet_round_only_a_level_change_or_a_request_runs_one(
        tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake, interval_s=0.1, quiet_interval_s=600.0)
    env.add_pod("batch1", fake=fake)
    stop = asyncio.Event()
    task, rounds = await counting_rounds(env, stop)
    await eventually(lambda: rounds() == 1)
    await asyncio.sleep(0.5)  # five periods: none ran
    assert rounds() == 1
    env.changed.call()  # a detector's level changed (from its publishing thread)
    await eventually(lambda: rounds() == 2)
    env.manager.request_round("the ladder's evict rung")
    await eventually(lambda: rounds() == 3)
    # Something met: rounds every period again.
    env.system.threshold = ThresholdMet(MetType.SOFT_MET)
    env.changed.call()
    await eventually(lambda: rounds() >= 6)
    stop.set()
    await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("what", ["level change", "request"])
async def test_a_level_change_or_a_request_during_a_round_runs_the_next_at_once(
        tmp_path: Path, fake: FakeApiServer, what: str) -> None:
    """Its round may already have read the levels: the change must not wait a quiet period."""
    env = make_env(tmp_path, fake, interval_s=0.1, quiet_interval_s=600.0)
    env.add_pod("batch1", fake=fake)
    answer = env.system.threshold_met
    pending = [env.changed.call if what == "level change"
               else lambda: env.manager.request_round("the ladder's evict rung")]

    async def changed_meanwhile() -> ThresholdMet:
        while pending:  # in the first round only
            pending.pop()()
        return await answer()

    env.system.threshold_met = changed_meanwhile  # type: ignore[method-assign]
    stop = asyncio.Event()
    task, rounds = await counting_rounds(env, stop)
    await eventually(lambda: rounds() == 2)
    await asyncio.sleep(0.3)  # then quiet again: no more rounds
    assert rounds() == 2
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_the_quiet_period_is_never_shorter_than_the_period(
        tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake, interval_s=0.3, quiet_interval_s=0.1)
    env.add_pod("batch1", fake=fake)
    stop = asyncio.Event()
    task, rounds = await counting_rounds(env, stop)
    await eventually(lambda: rounds() == 1)
    await asyncio.sleep(0.15)  # past the quiet period, short of the period
    assert rounds() == 1
    stop.set()
    await asyncio.wait_for(task, 10)
