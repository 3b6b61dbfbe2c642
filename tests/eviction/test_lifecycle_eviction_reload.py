"""A reload that holds evictions in dry run (observe mode, ``dry_run``) takes effect inside a
round already under way: a round's evictions follow each other, each up to a request timeout,
and the ones not sent yet must not go out after the node was switched to be watched only."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.eviction_env import forced, make_env
from tests.support.fake_apiserver import FakeApiServer

EVICTION = "/api/v1/namespaces/batch/pods/{}/eviction"


async def test_a_switch_to_dry_run_mid_round_holds_the_evictions_not_sent_yet(
        tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake, rate_burst=10)
    env.add_pod("a", fake=fake)
    env.add_pod("b", fake=fake)
    fake.delay_next("POST", EVICTION.format("a"), 0.5)
    forced(env, "a", "b")
    round_ = asyncio.create_task(env.round())
    async with asyncio.timeout(5):
        while not fake.requests("POST", EVICTION.format("a")):  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # only the server sees the request go out
    env.configure(dry_run=True)
    assert await round_ == [("batch/a", "evicted"), ("batch/b", "dry_run")]
    assert fake.requests("POST", EVICTION.format("b")) == []
    assert env.audited("eviction_dry_run") == ["batch/b"]
