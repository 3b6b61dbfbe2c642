"""A terminating pod is spared outright only while it is about to go: its author can delete it
with a grace period of years (``terminationGracePeriodSeconds`` has no upper bound) and have it
ignore SIGTERM, and a pod that is "terminating" for good must not be spared every round while
the others on the node are evicted in its place. Such a pod is still spared from an eviction
that would not end it sooner (a drained database with a long graceful shutdown)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.eviction.api import EvictPods, EvictRequest
from reconciler.eviction.facts import MAX_SPARED_TERMINATION_S
from tests.support.eviction_env import Env, forced, make_env
from tests.support.fake_apiserver import FakeApiServer

DELETED = "2026-01-01T00:00:00Z"
LONG = MAX_SPARED_TERMINATION_S + 1


def asking(env: Env, name: str, grace_s: int | None) -> None:
    env.system.evict = EvictPods((EvictRequest(env.uid(name), f"{name} must go", grace_s,
                                               True),))


async def test_a_pod_terminating_for_years_is_not_spared(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("lingering", fake=fake, deletionTimestamp=DELETED,
                deletionGracePeriodSeconds=1_000_000_000)
    asking(env, "lingering", 1)
    assert await env.round() == [("batch/lingering", "evicted")]
    offered = {p.name for p in env.system.called("GetEvictPods")[0]}
    assert "lingering" in offered


@pytest.mark.parametrize(("asked", "evicted"), [(LONG - 1, True), (LONG, False), (None, False)])
async def test_a_lingering_pod_goes_only_where_the_eviction_ends_it_sooner(
    tmp_path: Path, fake: FakeApiServer, asked: int | None, evicted: bool
) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("lingering", fake=fake, deletionTimestamp=DELETED,
                deletionGracePeriodSeconds=LONG)
    asking(env, "lingering", asked)
    assert await env.round() == ([("batch/lingering", "evicted")] if evicted else [])
    if not evicted:
        why = "its own grace" if asked is None else f"a grace of {asked} s"
        assert env.audited("eviction_filtered", "why") == [
            f"terminating with a grace of {LONG} s: an eviction with {why} would not end it "
            "sooner"]


async def test_a_pod_about_to_go_is_spared(tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("going", fake=fake, deletionTimestamp=DELETED,
                deletionGracePeriodSeconds=MAX_SPARED_TERMINATION_S)
    env.add_pod("unknown", fake=fake, deletionTimestamp=DELETED)
    forced(env, "going", "unknown")
    assert await env.round() == []
    assert env.audited("eviction_filtered", "why") == ["terminating", "terminating"]
