"""The eviction manager on the API's 409 and 429 answers: a conflict about the pod it chose is
tried again after the backoff, not taken for the pod's leaving, and a pod is never tried again
before the ``Retry-After`` its refusal carried. The real client against the fake API server, on
the manager's injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.kube.evictions import MAX_RETRY_AFTER_S
from tests.support.eviction_env import forced, make_env
from tests.support.fake_apiserver import FakeApiServer

EVICTION = "/api/v1/namespaces/batch/pods/db/eviction"


async def test_a_conflict_about_the_chosen_pod_is_retried_after_the_backoff(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake, rate_burst=10)
    env.add_pod("db", fake=fake)
    fake.fail_next("POST", EVICTION, 409)
    forced(env, "db")
    assert await env.round() == [("batch/db", "failed")]
    assert env.audited("eviction_gone") == []
    env.clock.now += 4.999  # the first backoff is 5 s
    assert await env.round() == []
    env.clock.now += 0.001
    assert await env.round() == [("batch/db", "evicted")]
    assert fake.pod("batch", "db") is None


@pytest.mark.parametrize(("status", "header", "wait_s", "outcome"), [
    (429, "7", 7.0, "blocked"),
    (429, "1", 5.0, "blocked"),  # shorter than the backoff: the backoff holds
    (429, str(MAX_RETRY_AFTER_S + 1), float(MAX_RETRY_AFTER_S), "blocked"),
    (503, "7", 7.0, "failed"),
])
async def test_a_refused_pod_is_not_tried_again_before_its_retry_after(
    tmp_path: Path, fake: FakeApiServer, status: int, header: str, wait_s: float, outcome: str
) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("db", fake=fake)
    fake.fail_next("POST", EVICTION, status, retry_after=header)
    forced(env, "db")
    assert await env.round() == [("batch/db", outcome)]
    env.clock.now += wait_s - 0.001
    assert await env.round() == []
    (deferred,) = env.sink.named("eviction_deferred")
    assert deferred["why"].endswith("next try in 0.0 s")
    env.clock.now += 0.001
    assert await env.round() == [("batch/db", "evicted")]
    posts = [r for r in fake.requests("POST") if r.path == EVICTION]
    assert [r.status for r in posts] == [status, 201]


async def test_a_disruption_budget_retry_after_holds_the_pod_too(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("db", fake=fake)
    fake.block_eviction("batch", "db", retry_after="10")
    forced(env, "db")
    assert await env.round() == [("batch/db", "blocked")]
    fake.unblock_eviction("batch", "db")
    env.clock.now += 9.999
    assert await env.round() == []
    env.clock.now += 0.001
    assert await env.round() == [("batch/db", "evicted")]
