"""The eviction manager keeps going and stops: a protected pod ranked first does not keep every
other pod on the node, and a round held up by a slow API server does not hold up a stop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from reconciler.eviction.api import ActivePod, MetType, ThresholdMet, TopPods
from reconciler.eviction.builtin import largest_first
from tests.support.eviction_env import GIB, forced, make_env
from tests.support.fake_apiserver import FakeApiServer
from tests.support.polling import eventually


async def test_top_pods_are_asked_among_the_pods_the_filter_lets_go(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    """The largest offline pods are protected (a DaemonSet's, an excluded namespace's): named
    first, they would be refused every round and no other pod would ever go."""
    env = make_env(tmp_path, fake, met_rounds=1, top_n=1)
    env.add_pod("ds", owner="DaemonSet", anon=4 * GIB, fake=fake)
    (ref,) = fake.pod("batch", "ds")["metadata"]["ownerReferences"]  # type: ignore[index]
    fake.add_daemonset("batch", ref["name"], ref["uid"])
    env.add_pod("infra", namespace="kube-system", anon=3 * GIB, fake=fake)
    env.add_pod("a", anon=GIB, fake=fake)
    env.system.threshold = ThresholdMet(MetType.HARD_MET)
    offered: list[list[str]] = []

    async def largest(active: Sequence[ActivePod], top_n: int, scope: str) -> TopPods:
        offered.append([pod.name for pod in active])
        return TopPods(tuple(p.uid for p in largest_first(active, ("reclaimed_cores",), top_n)))

    env.system.get_top_eviction_pods = largest  # type: ignore[method-assign]
    assert await env.round() == [("batch/a", "evicted")]
    assert offered == [["a"]]
    assert env.audited("eviction_filtered") == []


async def test_a_stop_ends_a_round_held_up_by_a_slow_api_server(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    """A round may wait on the API for many request timeouts in a row; a stop does not."""
    env = make_env(tmp_path, fake, request_timeout_s=5.0)
    env.add_pod("batch1", fake=fake)
    fake.delay_next("POST", "/api/v1/namespaces/batch/pods/batch1/eviction", 10.0)
    forced(env, "batch1")
    stop = asyncio.Event()
    task = asyncio.create_task(env.manager.run(stop))
    await eventually(lambda: bool(fake.requests("POST")))
    stop.set()
    await asyncio.wait_for(task, 1.0)
    assert env.audited("eviction_done") == []
