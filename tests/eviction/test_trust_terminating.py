"""A terminating pod is spared only while it is about to go: its author can delete it with a
grace period of years (``terminationGracePeriodSeconds`` has no upper bound) and have it ignore
SIGTERM, and a pod that is "terminating" for good must not be spared every round while the
others on the node are evicted in its place."""

from __future__ import annotations

from pathlib import Path

from reconciler.eviction.facts import MAX_SPARED_TERMINATION_S
from tests.support.eviction_env import forced, make_env
from tests.support.fake_apiserver import FakeApiServer

DELETED = "2026-01-01T00:00:00Z"


async def test_a_pod_terminating_for_years_is_not_spared(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("lingering", fake=fake, deletionTimestamp=DELETED,
                deletionGracePeriodSeconds=1_000_000_000)
    forced(env, "lingering")
    assert await env.round() == [("batch/lingering", "evicted")]
    offered = {p.name for p in env.system.called("GetEvictPods")[0]}
    assert "lingering" in offered


async def test_a_pod_about_to_go_is_spared(tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("going", fake=fake, deletionTimestamp=DELETED,
                deletionGracePeriodSeconds=MAX_SPARED_TERMINATION_S)
    env.add_pod("unknown", fake=fake, deletionTimestamp=DELETED)
    forced(env, "going", "unknown")
    assert await env.round() == []
    assert env.audited("eviction_filtered", "why") == ["terminating", "terminating"]
