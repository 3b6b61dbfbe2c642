"""The eviction manager's rounds: in-tree plugins scripted by the test, pods on a fake host tree,
the real kubernetes client against the fake API server, an injected clock."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from reconciler.eviction.api import (
    ActivePod,
    Condition,
    EvictPods,
    EvictRequest,
    MetType,
    Operator,
    ThresholdMet,
    TopPods,
)
from tests.support.eviction_env import GIB, forced, make_env
from tests.support.fake_apiserver import FakeApiServer, make_pod

# ---- dry-run ------------------------------------------------------------------------------------


async def test_dry_run_decides_audits_and_writes_nothing(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake, dry_run=True)
    env.add_pod("batch1", fake=fake)
    env.system.threshold = ThresholdMet(MetType.SOFT_MET,
                                        condition=Condition("NriQosSystemMemoryPressure", True))
    forced(env, "batch1")
    assert await env.round() == [("batch/batch1", "dry_run")]
    assert env.audited("eviction_candidate") == ["batch/batch1"]
    (chosen,) = env.sink.named("eviction_chosen")
    assert (chosen["plugin"], chosen["dry_run"], chosen["reason"]) == (
        "system_pressure", True, "batch1 must go")
    assert chosen["memory_usage_bytes"] == GIB
    assert env.audited("eviction_dry_run") == ["batch/batch1"]
    (condition,) = env.sink.named("eviction_condition")
    assert (condition["condition"], condition["status"], condition["dry_run"]) == (
        "NriQosSystemMemoryPressure", True, True)
    # The API saw nothing: no eviction, no Event, no condition.
    assert fake.requests("POST") == []
    assert fake.requests("PATCH") == []
    # Decided once: the next rounds do not choose the pod again.
    assert await env.round() == []
    assert env.audited("eviction_filtered", "why") == ["already being evicted (dry-run)"]
    assert len(env.sink.named("eviction_chosen")) == 1


async def test_dry_run_per_plugin(tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake, dry_run_plugins=("rss_overuse",))
    env.add_pod("a", fake=fake)
    env.add_pod("b", fake=fake, anon=2 * GIB)
    forced(env, "a")
    forced(env, "b", plugin=env.rss)
    assert await env.round() == [("batch/b", "dry_run"), ("batch/a", "evicted")]
    assert [r.path for r in fake.requests("POST") if r.path.endswith("eviction")] == [
        "/api/v1/namespaces/batch/pods/a/eviction"]
    # A dry-run decision is forgotten once the plugin is no longer dry.
    env.configure(dry_run_plugins=())
    assert await env.round() == [("batch/b", "evicted")]


async def test_a_pod_re_created_under_the_same_name_is_not_evicted(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("a", fake=fake)
    # The API's pod "a" is another one now (deleted and re-created); the node still runs the
    # one the decision is about.
    fake.modify_pod("batch", "a", lambda pod: pod["metadata"].update(uid="someone-else"))
    forced(env, "a")
    assert await env.round() == [("batch/a", "gone")]
    assert fake.pod("batch", "a") is not None


@pytest.mark.parametrize(("exists", "outcome"), [
    ("same uid", []),
    ("another uid", [("batch/ds", "evicted")]),
    ("no", [("batch/ds", "evicted")]),
])
async def test_a_daemonset_owner_counts_only_once_the_api_shows_it(
    tmp_path: Path, fake: FakeApiServer, exists: str, outcome: list[tuple[str, str]]
) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("ds", owner="DaemonSet", fake=fake)
    (ref,) = fake.pod("batch", "ds")["metadata"]["ownerReferences"]  # type: ignore[index]
    if exists != "no":
        fake.add_daemonset("batch", ref["name"],
                           ref["uid"] if exists == "same uid" else "someone-else")
    forced(env, "ds")
    assert await env.round() == outcome
    daemonset_gets = [r for r in fake.requests("GET") if "/daemonsets/" in r.path]
    assert [r.path for r in daemonset_gets] == [
        f"/apis/apps/v1/namespaces/batch/daemonsets/{ref['name']}"]


async def test_an_unconfirmed_daemonset_owner_waits_and_the_answer_is_kept(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("ds", owner="DaemonSet", fake=fake)
    (ref,) = fake.pod("batch", "ds")["metadata"]["ownerReferences"]  # type: ignore[index]
    fake.add_daemonset("batch", ref["name"], ref["uid"])
    fake.fail_next("GET", "/apis/apps/v1/", 503)
    forced(env, "ds")
    assert await env.round() == []
    assert env.audited("eviction_filtered", "why") == [
        "DaemonSet owner not confirmed by the API yet"]
    assert await env.round() == []
    assert await env.round() == []
    # Confirmed once, then kept: one more request, not one per round.
    assert len([r for r in fake.requests("GET") if "/daemonsets/" in r.path]) == 2
    assert env.audited("eviction_filtered", "why")[-1] == "owned by a DaemonSet"


# ---- filter -------------------------------------------------------------------------------------


async def test_filtered_pods_are_audited_once_with_the_reason(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake, exclude_selectors=("team=infra",),
                   exclude_selector_namespaces=("batch",))
    env.add_pod("sys", level="system_cores", namespace="kube-system", fake=fake)
    env.add_pod("ds", owner="DaemonSet", fake=fake)
    (ref,) = fake.pod("batch", "ds")["metadata"]["ownerReferences"]  # type: ignore[index]
    fake.add_daemonset("batch", ref["name"], ref["uid"])
    env.add_pod("crit", priority=2_000_001_000, fake=fake)
    env.add_pod("going", fake=fake, deletionTimestamp="2026-01-01T00:00:00Z")
    env.add_pod("infra", fake=fake, labels={"team": "infra"})
    env.add_pod("ok", fake=fake)
    forced(env, "sys", "ds", "crit", "going", "infra", "ok")
    env.system.evict = EvictPods((*env.system.evict.pods,
                                  EvictRequest("no-such-uid", "ghost", None, True)))
    assert await env.round() == [("batch/ok", "evicted")]
    whys = dict(zip(env.audited("eviction_filtered"), env.audited("eviction_filtered", "why"),
                    strict=True))
    assert whys == {
        "kube-system/sys": "system_cores pod",
        "batch/ds": "owned by a DaemonSet",
        "batch/crit": "priority 2000001000 >= 2000000000",
        "batch/going": "terminating",
        "batch/infra": "labels match excluded selector 'team=infra'",
        "uid no-such-uid": "not a running pod of this node",
    }
    # The terminating pod is not even offered to plugins.
    offered = {p.name for p in env.system.called("GetEvictPods")[0]}
    assert "going" not in offered
    assert {"sys", "ds", "crit", "infra", "ok"} <= offered
    await env.round()
    assert len(env.sink.named("eviction_filtered")) == 7  # + "already being evicted" for ok
    assert env.sink.named("eviction_filtered")[-1]["why"] == "already being evicted"


# ---- rate limit, ranking ------------------------------------------------------------------------


async def test_forced_evictions_pass_the_shared_token_bucket_in_rank_order(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("small", anon=GIB, fake=fake)
    env.add_pod("online", level="shared_cores", anon=9 * GIB, fake=fake)
    env.add_pod("big", anon=4 * GIB, fake=fake)
    env.add_pod("prio", anon=8 * GIB, priority=100, fake=fake)
    env.add_pod("mid", anon=2 * GIB, fake=fake)
    forced(env, "small", "online", "big")
    forced(env, "prio", "mid", plugin=env.rss)
    assert await env.round() == [
        ("batch/big", "evicted"), ("batch/mid", "evicted"), ("batch/small", "evicted"),
        ("batch/prio", "rate_limited"), ("batch/online", "rate_limited")]
    deferred = env.sink.named("eviction_deferred")
    assert [d["pod"] for d in deferred] == ["batch/prio", "batch/online"]
    assert deferred[0]["why"] == "rate limit: next token in 10.0 s"
    # Events on the evicted pods, naming the plugin and the signal.
    events = fake.events()
    assert [e["involvedObject"]["name"] for e in events] == ["big", "mid", "small"]
    assert events[1]["reason"] == "NriQosEvicted"
    assert events[1]["message"] == "Evicted by nri-qos, plugin rss_overuse: mid must go"
    assert events[0]["involvedObject"]["uid"] == env.uid("big")
    env.clock.now += 9.999
    assert await env.round() == [("batch/prio", "rate_limited"),
                                 ("batch/online", "rate_limited")]
    assert len(env.sink.named("eviction_deferred")) == 2  # still deferred: not audited again
    env.clock.now += 0.001
    assert await env.round() == [("batch/prio", "evicted"), ("batch/online", "rate_limited")]


async def test_soft_candidates_one_per_round_best_first(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake, rate_burst=10)
    env.add_pod("a", anon=GIB, fake=fake)
    env.add_pod("b", anon=3 * GIB, fake=fake)
    env.add_pod("c", anon=2 * GIB, fake=fake)
    forced(env, "a", "b", "c", plugin=env.rss, force=False)
    assert await env.round() == [("batch/b", "evicted")]
    assert await env.round() == [("batch/c", "evicted")]
    env.configure(soft_per_round=0)
    assert await env.round() == []


# ---- API outcomes -------------------------------------------------------------------------------


async def test_blocked_by_a_disruption_budget_retried_later_and_evicted_once(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake, rate_burst=1)
    env.add_pod("db", fake=fake)
    env.add_pod("other", fake=fake)
    fake.block_eviction("batch", "db")
    forced(env, "db")
    assert await env.round() == [("batch/db", "blocked")]
    # The refusal evicted nothing: the only token is still there for another pod.
    forced(env, "db", "other")
    env.clock.now += 1
    assert await env.round() == [("batch/other", "evicted")]
    (deferred,) = env.sink.named("eviction_deferred")
    assert deferred["pod"] == "batch/db"
    assert deferred["why"].startswith("backing off after 1 refused or failed eviction(s)")
    env.clock.now += 4 + 10  # past the 5 s backoff, and a token is back
    assert await env.round() == [("batch/db", "blocked")]
    fake.unblock_eviction("batch", "db")
    env.clock.now += 9.9  # the second backoff is 10 s
    assert await env.round() == []
    env.clock.now += 0.1
    assert await env.round() == [("batch/db", "evicted")]
    for _ in range(3):
        env.clock.now += 60
        assert await env.round() == []
    posts = [r for r in fake.requests("POST") if r.path.endswith("/db/eviction")]
    assert [r.status for r in posts] == [429, 429, 201]
    assert env.audited("eviction_done") == ["batch/other", "batch/db"]
    # Status shows the decisions newest first; the rate-limited deferral is not one.
    assert [(r.pod, r.outcome.value, r.reason) for _, r in env.manager.recent()] == [
        ("batch/db", "evicted", "db must go"), ("batch/db", "blocked", "db must go"),
        ("batch/other", "evicted", "other must go"), ("batch/db", "blocked", "db must go")]
    # by the manager's clock: the rounds ran at +0, +1, +15 and +25 s; now is +205 s
    assert [age for age, _ in env.manager.recent()] == [180.0, 190.0, 204.0, 205.0]

    def evictions(result: str) -> float | None:
        return env.metrics.registry.get_sample_value(
            "nri_qos_evictions_total", {"plugin": "system_pressure", "result": result})

    assert (evictions("evicted"), evictions("blocked")) == (2.0, 2.0)
    assert evictions("rate_limited") is None


async def test_gone_failed_and_timed_out_evictions(tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake, rate_burst=10, request_timeout_s=0.3)
    env.add_pod("vanished")  # known to the node, unknown to the API: 404
    env.add_pod("broken", fake=fake)
    env.add_pod("slow", fake=fake)
    fake.fail_next("POST", "/api/v1/namespaces/batch/pods/broken/eviction", 500)
    fake.delay_next("POST", "/api/v1/namespaces/batch/pods/slow/eviction", 5.0)
    forced(env, "vanished", "broken", "slow")
    assert await env.round() == [("batch/vanished", "gone"), ("batch/broken", "failed"),
                                 ("batch/slow", "failed")]
    assert env.audited("eviction_gone") == ["batch/vanished"]
    assert [b["pod"] for b in env.sink.named("eviction_blocked")] == [
        "batch/broken", "batch/slow"]
    assert "500" in env.sink.named("eviction_blocked")[0]["reason"]
    # A pod found gone is not asked again; failed ones are retried after the backoff.
    env.clock.now += 5
    assert await env.round() == [("batch/broken", "evicted"), ("batch/slow", "evicted")]
    assert env.audited("eviction_filtered", "why")[-1] == "already being evicted"


async def test_without_api_access_it_decides_audits_and_says_once(tmp_path: Path) -> None:
    env = make_env(tmp_path, None, rate_burst=10)
    env.add_pod("a")
    env.add_pod("b")
    forced(env, "a", "b")
    with capture_logs() as logs:
        assert await env.round() == [("batch/a", "unavailable"), ("batch/b", "unavailable")]
        env.clock.now += 5
        assert await env.round() == [("batch/a", "unavailable"), ("batch/b", "unavailable")]
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["eviction_unavailable"]
    assert env.audited("eviction_chosen") == ["batch/a", "batch/b"] * 2
    assert {b["reason"] for b in env.sink.named("eviction_blocked")} == {
        "no Kubernetes API access"}


# ---- thresholds ---------------------------------------------------------------------------------


async def test_hard_met_asks_for_top_pods_after_the_streak(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake, met_rounds=2, top_n=2)
    env.add_pod("a", fake=fake)
    env.add_pod("b", fake=fake)
    env.system.threshold = ThresholdMet(MetType.HARD_MET, 100.0, 50.0, Operator.LESS_THAN,
                                        "node", signal="system_free", unit="bytes")
    env.system.top = TopPods((env.uid("b"),), grace_s=3)
    assert await env.round() == []
    assert env.system.called("GetTopEvictionPods") == []
    assert await env.round() == [("batch/b", "evicted")]
    ((active, top_n, scope),) = env.system.called("GetTopEvictionPods")
    assert (sorted(p.name for p in active), top_n, scope) == (["a", "b"], 2, "node")
    (chosen,) = env.sink.named("eviction_chosen")
    assert chosen["reason"] == "threshold hard-met: system_free node: 50 bytes < 100 bytes"
    assert chosen["grace_s"] == 3
    (post,) = [r for r in fake.requests("POST") if r.path.endswith("eviction")]
    assert post.body["deleteOptions"] == {"gracePeriodSeconds": 3,
                                          "preconditions": {"uid": env.uid("b")}}
    # A soft-met round breaks the streak.
    env.system.threshold = ThresholdMet(MetType.SOFT_MET)
    await env.round()
    env.system.threshold = ThresholdMet(MetType.HARD_MET)
    await env.round()
    assert len(env.system.called("GetTopEvictionPods")) == 1


async def test_offered_pods_carry_what_plugins_need(tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake)
    env.add_pod("a", anon=3 * GIB, priority=7, fake=fake)
    await env.round()
    (offered,) = env.system.called("GetEvictPods")[0]
    assert offered == ActivePod(env.uid("a"), "batch", "a", "reclaimed_cores", 7, GIB, 3 * GIB)


# ---- plugins that misbehave ---------------------------------------------------------------------


async def test_a_hung_or_failing_plugin_costs_only_its_own_round(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake, call_timeout_s=0.05, rate_burst=10)
    env.add_pod("a", fake=fake)
    env.add_pod("b", fake=fake)
    env.system.hang = True
    env.rss.fail = True
    forced(env, "a")
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await env.round() == []
    # two phases of 0.05 s deadlines, where the hung plugin would take 30 s; the bound leaves
    # room for a busy machine
    assert loop.time() - started < 5.0
    failed = env.sink.named("eviction_plugin_failed")
    assert sorted((f["plugin"], f["call"], f["kind"]) for f in failed) == [
        ("rss_overuse", "GetEvictPods", "error"), ("rss_overuse", "ThresholdMet", "error"),
        ("system_pressure", "GetEvictPods", "deadline"),
        ("system_pressure", "ThresholdMet", "deadline")]
    await env.round()
    assert len(env.sink.named("eviction_plugin_failed")) == 4  # a streak is audited once
    env.system.hang = False
    forced(env, "b", plugin=env.rss)
    env.rss.fail = False
    assert await env.round() == [("batch/a", "evicted"), ("batch/b", "evicted")]
    recovered = env.sink.named("eviction_plugin_recovered")
    assert sorted((r["plugin"], r["call"], r["failures"]) for r in recovered) == [
        ("rss_overuse", "GetEvictPods", 2), ("rss_overuse", "ThresholdMet", 2),
        ("system_pressure", "GetEvictPods", 2), ("system_pressure", "ThresholdMet", 2)]


# ---- the loop -----------------------------------------------------------------------------------


async def test_request_round_runs_one_at_once(tmp_path: Path) -> None:
    env = make_env(tmp_path, None, interval_s=60.0)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(env.manager.run(stop))
        for _ in range(100):
            if env.system.called("ThresholdMet"):
                break
            await asyncio.sleep(0.01)
        assert len(env.system.called("ThresholdMet")) == 1
        with capture_logs() as logs:
            # From another thread, as a ladder running in a worker might.
            await asyncio.to_thread(env.manager.request_round, "evict rung: psi high")
            for _ in range(100):
                if len(env.system.called("ThresholdMet")) == 2:
                    break
                await asyncio.sleep(0.01)
        assert len(env.system.called("ThresholdMet")) == 2
        assert [e["reason"] for e in logs if e["event"] == "eviction_round_requested"] == [
            "evict rung: psi high"]
        stop.set()


async def test_disabled_manager_idles(tmp_path: Path) -> None:
    env = make_env(tmp_path, None, enabled=False, interval_s=0.1)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(env.manager.run(stop))
        await asyncio.sleep(0.3)
        assert env.system.calls == []
        env.configure(enabled=True)
        for _ in range(100):
            if env.system.calls:
                break
            await asyncio.sleep(0.01)
        assert env.system.calls
        stop.set()
    env.manager.request_round("after stop")  # the loop is gone: nothing to wake, no error


async def test_an_evicted_pod_still_on_the_node_is_asked_again_only_after_the_window(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    env = make_env(tmp_path, fake, reevict_after_s=300.0, rate_burst=10)
    env.add_pod("stuck", fake=fake)
    forced(env, "stuck")
    assert await env.round() == [("batch/stuck", "evicted")]
    # The API deleted it, but the runtime still runs it (a long grace period, a stuck kill).
    fake.add_pod(make_pod("stuck", namespace="batch", uid=env.uid("stuck")))
    env.clock.now += 299.999
    assert await env.round() == []
    env.clock.now += 0.001
    assert await env.round() == [("batch/stuck", "evicted")]
