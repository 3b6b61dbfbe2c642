"""The eviction manager on the API's 409 and 429 answers: a conflict about the pod it chose is
tried again after the backoff, not taken for the pod's leaving, and gives its token back; a pod
is never tried again before the ``Retry-After`` its refusal carried, counted from the answer;
the API server's throttling ends the round and its Retry-After holds every pod, a disruption
budget's refusal does neither. The real
client against the fake API server, on the manager's injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.kube.evictions import MAX_RETRY_AFTER_S
from tests.support.eviction_env import GIB, forced, make_env
from tests.support.fake_apiserver import FakeApiServer
from tests.support.fake_apiserver_http import Handler, Recorded

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


async def test_a_retry_after_counts_from_the_answer_not_from_the_rounds_start(
    tmp_path: Path, fake: FakeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The round's earlier evictions take their time (each POST here 3 s by the manager's
    clock): the refused pod's wait starts when its own answer came."""
    env = make_env(tmp_path, fake)
    for name, gib in (("first", 3), ("second", 2), ("db", 1)):
        env.add_pod(name, anon=gib * GIB, fake=fake)
    evict = Handler._evict

    def slow(handler: Handler, record: Recorded, namespace: str, name: str) -> None:
        env.clock.now += 3.0
        evict(handler, record, namespace, name)

    monkeypatch.setattr(Handler, "_evict", slow)
    fake.fail_next("POST", EVICTION, 429, retry_after="7")
    forced(env, "first", "second", "db")
    started = env.clock.now
    assert await env.round() == [("batch/first", "evicted"), ("batch/second", "evicted"),
                                 ("batch/db", "blocked")]
    answered = started + 6.0
    assert env.clock.now == answered
    env.clock.now = answered + 7.0 - 0.001
    assert await env.round() == []
    env.clock.now = answered + 7.0
    assert await env.round() == [("batch/db", "evicted")]


async def test_a_throttled_eviction_ends_the_round_and_the_rest_keep_their_tokens(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    """Priority and Fairness throttles this client, not one pod: the next POST of the round
    would be throttled too. Two tokens, exactly what the two left over need next round."""
    env = make_env(tmp_path, fake, rate_burst=2)
    for name, gib in (("db", 3), ("second", 2), ("third", 1)):
        env.add_pod(name, anon=gib * GIB, fake=fake)
    fake.fail_next("POST", EVICTION, 429)
    forced(env, "db", "second", "third")
    assert await env.round() == [("batch/db", "blocked"), ("batch/second", "throttled"),
                                 ("batch/third", "throttled")]
    assert [r.path for r in fake.requests("POST") if r.path.endswith("/eviction")] == [EVICTION]
    # The fake answers as Priority and Fairness does, with Retry-After: 1.
    assert [(r["pod"], r["why"]) for r in env.sink.named("eviction_deferred")] == [
        (f"batch/{name}", "the API server throttles evictions: next try in 1.0 s")
        for name in ("second", "third")]
    env.clock.now += 1.0
    assert await env.round() == [("batch/second", "evicted"), ("batch/third", "evicted")]


async def test_a_throttling_retry_after_holds_every_eviction_until_it_ends(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    """The Retry-After of a throttled eviction is the client's to keep, for every pod: the
    next round sends nothing before it ends."""
    env = make_env(tmp_path, fake, rate_burst=10)
    for name, gib in (("db", 2), ("second", 1)):
        env.add_pod(name, anon=gib * GIB, fake=fake)
    fake.fail_next("POST", EVICTION, 429, retry_after="7")
    forced(env, "db", "second")
    assert await env.round() == [("batch/db", "blocked"), ("batch/second", "throttled")]
    assert [(r["pod"], r["why"]) for r in env.sink.named("eviction_deferred")] == [
        ("batch/second", "the API server throttles evictions: next try in 7.0 s")]
    env.clock.now += 7.0 - 0.001
    assert await env.round() == [("batch/second", "throttled")]
    assert len([r for r in fake.requests("POST") if r.path.endswith("/eviction")]) == 1
    env.clock.now += 0.001
    assert await env.round() == [("batch/db", "evicted"), ("batch/second", "evicted")]


async def test_a_disruption_budget_refusal_does_not_end_the_round(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake)
    for name, gib in (("db", 3), ("second", 2)):
        env.add_pod(name, anon=gib * GIB, fake=fake)
    fake.block_eviction("batch", "db")
    forced(env, "db", "second")
    assert await env.round() == [("batch/db", "blocked"), ("batch/second", "evicted")]


@pytest.mark.parametrize("read_back", ["the same pod", "not readable"])
async def test_a_conflict_gives_its_token_back(
    tmp_path: Path, fake: FakeApiServer, read_back: str
) -> None:
    """A 409 is the API's answer that it evicted nothing: the one token goes to the next pod,
    and the one after waits."""
    env = make_env(tmp_path, fake, rate_burst=1)
    for name, gib in (("db", 3), ("second", 2), ("third", 1)):
        env.add_pod(name, anon=gib * GIB, fake=fake)
    fake.fail_next("POST", EVICTION, 409)
    if read_back == "not readable":
        fake.fail_next("GET", "/api/v1/namespaces/batch/pods/db", 500)
    forced(env, "db", "second", "third")
    assert await env.round() == [("batch/db", "failed"), ("batch/second", "evicted"),
                                 ("batch/third", "rate_limited")]
    assert fake.pod("batch", "db") is not None
