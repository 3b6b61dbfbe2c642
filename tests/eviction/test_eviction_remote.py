"""Out-of-tree eviction plugins: real plugin processes speaking gRPC on unix sockets, the
registry of the socket directory, and the checks on what a plugin answers."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from protos import eviction_pb2 as pb
from reconciler.eviction.api import (
    ActivePod,
    Condition,
    EvictPods,
    EvictRequest,
    MetType,
    Operator,
)
from reconciler.eviction.proposals import MAX_AUDITED_PROPOSALS
from reconciler.eviction.remote import (
    PluginCallError,
    PluginDirectory,
    evict_pods_from,
    pod_message,
    threshold_from,
    top_pods_from,
)
from tests.support.eviction_env import GIB, make_env
from tests.support.fake_apiserver import FakeApiServer
from tests.support.paths import REPO
from tests.support.plugin_process import plugin_process

# ---- what a plugin answers ----------------------------------------------------------------------


def test_pod_message_carries_only_what_is_known() -> None:
    full = pod_message(ActivePod("u", "ns", "n", "reclaimed_cores", -3, 10, 20))
    assert (full.uid, full.namespace, full.name, full.qos_level) == (
        "u", "ns", "n", pb.RECLAIMED_CORES)
    assert (full.priority, full.memory_request_bytes, full.memory_usage_bytes) == (-3, 10, 20)
    bare = pod_message(ActivePod("u", "ns", "n", "shared_cores", None, None, None))
    assert bare.qos_level == pb.SHARED_CORES
    assert not any(bare.HasField(f) for f in ("priority", "memory_request_bytes",
                                              "memory_usage_bytes"))


def test_threshold_answer() -> None:
    answer = threshold_from(pb.ThresholdMetResponse(
        threshold_value=0.5, observed_value=0.75, threshold_operator=pb.GREATER_THAN,
        met_type=pb.HARD_MET, eviction_scope="memory",
        condition=pb.Condition(type=pb.NODE_CONDITION, name="ExamplePressure", met=True)))
    assert (answer.met, answer.operator, answer.scope, answer.condition) == (
        MetType.HARD_MET, Operator.GREATER_THAN, "memory", Condition("ExamplePressure", True))
    assert answer.describe() == "memory: 0.75 > 0.5"
    assert threshold_from(pb.ThresholdMetResponse()).condition is None


@pytest.mark.parametrize(("message", "problem"), [
    (pb.ThresholdMetResponse(met_type=7), "met_type 7 is not a MetType"),  # type: ignore[arg-type]
    (pb.ThresholdMetResponse(threshold_operator=9), "threshold_operator 9"),  # type: ignore[arg-type]
    (pb.ThresholdMetResponse(observed_value=float("nan")), "not a finite number"),
    (pb.ThresholdMetResponse(condition=pb.Condition(name="lowercase")), "not CamelCase"),
    (pb.ThresholdMetResponse(condition=pb.Condition(name="MemoryPressure")),
     "belongs to kubelet"),
    (pb.ThresholdMetResponse(condition=pb.Condition(type=5, name="Fine")), "condition type 5"),  # type: ignore[arg-type]
    (pb.ThresholdMetResponse(condition=pb.Condition(name="A" * 64)), "not CamelCase"),
])
def test_threshold_garbage(message: pb.ThresholdMetResponse, problem: str) -> None:
    with pytest.raises(PluginCallError, match=problem) as caught:
        threshold_from(message)
    assert caught.value.kind == "invalid answer"


def test_top_pods_and_evict_pods_answers() -> None:
    top = pb.GetTopEvictionPodsResponse(target_pod_uids=["a", "b"])
    assert top_pods_from(top, 2).uids == ("a", "b")
    with pytest.raises(PluginCallError, match="2 pods where at most 1"):
        top_pods_from(top, 1)
    top.grace_period_seconds = 86_400
    assert top_pods_from(top, 2).grace_s == 86_400
    top.grace_period_seconds = 86_401
    with pytest.raises(PluginCallError, match="grace period 86401"):
        top_pods_from(top, 2)
    top.grace_period_seconds = -1
    with pytest.raises(PluginCallError, match="grace period -1"):
        top_pods_from(top, 2)
    # 0 is immediate deletion, no graceful shutdown: refused; 1 s is the least.
    top.grace_period_seconds = 0
    with pytest.raises(PluginCallError, match=r"grace period 0 s is outside 1\.\.86400"):
        top_pods_from(top, 2)
    top.grace_period_seconds = 1
    assert top_pods_from(top, 2).grace_s == 1
    with pytest.raises(PluginCallError, match="grace period 0"):
        evict_pods_from(pb.GetEvictPodsResponse(evict_pods=[
            pb.EvictPod(uid="b", grace_period_seconds=0)]))
    wanted = evict_pods_from(pb.GetEvictPodsResponse(evict_pods=[
        pb.EvictPod(uid="a", reason="x" * 500, force=True),
        pb.EvictPod(uid="b", grace_period_seconds=1)]))
    assert [(p.uid, p.force, p.grace_s) for p in wanted.pods] == [("a", True, None),
                                                                 ("b", False, 1)]
    assert wanted.pods[0].reason.startswith("x" * 128 + "… (500 chars")
    assert wanted.pods[1].reason == "no reason given"
    with pytest.raises(PluginCallError, match="without uid"):
        evict_pods_from(pb.GetEvictPodsResponse(evict_pods=[pb.EvictPod(reason="?")]))


# ---- the socket directory -----------------------------------------------------------------------


def listening(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    return server


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for s in opened:
        s.close()


async def test_directory_registers_and_drops(tmp_path: Path,
                                            sockets: list[socket.socket]) -> None:
    sink = MemoryAuditSink()
    directory = PluginDirectory(AuditLog(sink), lambda: 0.1)
    where = tmp_path / "plugins"
    try:
        assert await directory.scan(str(where), reserved={"rss_overuse"}) == []
        where.mkdir()
        sockets.append(listening(where / "alpha.sock"))
        sockets.append(listening(where / "rss_overuse.sock"))
        sockets.append(listening(where / "bad name.sock"))
        (where / "file.sock").write_text("not a socket")
        (where / "README").write_text("ignored")
        found = await directory.scan(str(where), reserved={"rss_overuse"})
        assert [p.name for p in found] == ["alpha"]
        assert sink.named("eviction_plugin_registered") == [
            {"plugin": "alpha", "socket": str(where / "alpha.sock")}]
        refused = {r["plugin"]: r["reason"] for r in sink.named("eviction_plugin_dropped")}
        assert refused == {"rss_overuse": "refused: name of an in-tree plugin",
                           "bad name": "refused: name is not [A-Za-z0-9_.-]{1,64}",
                           "file": "refused: not a unix socket"}
        # Steady: nothing new to audit, the same plugin object.
        again = await directory.scan(str(where), reserved={"rss_overuse"})
        assert again[0] is found[0]
        assert len(sink.records) == 4
        # A restarted plugin (a new socket under the same name) gets a fresh channel.
        sockets[0].close()
        (where / "alpha.sock").unlink()
        sockets.append(listening(where / "alpha.sock"))
        restarted = await directory.scan(str(where), reserved={"rss_overuse"})
        assert restarted[0] is not found[0]
        assert len(sink.named("eviction_plugin_registered")) == 1
        (where / "alpha.sock").unlink()
        assert await directory.scan(str(where), reserved={"rss_overuse"}) == []
        assert sink.named("eviction_plugin_dropped")[-1] == {
            "plugin": "alpha", "reason": "socket removed", "socket": str(where / "alpha.sock")}
    finally:
        await directory.close()


# In a fresh interpreter that imported the whole agent: whether gRPC is loaded after a scan of
# an empty plugin directory, then after one that finds a plugin.
GRPC_ON_DEMAND = """
import asyncio, socket, sys
import nri_plugin.agent  # everything the running agent imports
from common.audit import AuditLog, MemoryAuditSink
from reconciler.eviction.remote import PluginDirectory

async def main() -> None:
    directory = PluginDirectory(AuditLog(MemoryAuditSink()), lambda: 0.1)
    await directory.scan(sys.argv[1], reserved=())
    print("grpc" in sys.modules)
    plugin = socket.socket(socket.AF_UNIX)
    plugin.bind(sys.argv[1] + "/alpha.sock")
    found = await directory.scan(sys.argv[1], reserved=())
    print("grpc" in sys.modules, [p.name for p in found])
    await directory.close()
    plugin.close()

asyncio.run(main())
"""


def test_grpc_is_loaded_with_the_first_plugin_only(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", GRPC_ON_DEMAND, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False", "True ['alpha']"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a socket to another user")
async def test_directory_refuses_a_socket_of_another_user(
    tmp_path: Path, sockets: list[socket.socket]
) -> None:
    sink = MemoryAuditSink()
    directory = PluginDirectory(AuditLog(sink), lambda: 0.1)
    sockets.append(listening(tmp_path / "intruder.sock"))
    os.chown(tmp_path / "intruder.sock", 65534, 65534)
    try:
        assert await directory.scan(str(tmp_path), reserved=()) == []
        (dropped,) = sink.named("eviction_plugin_dropped")
        assert dropped["reason"] == (
            "refused: owned by uid 65534, not root or the agent's user")
    finally:
        await directory.close()


@pytest.mark.parametrize(("mode", "trusted"), [(0o755, True), (0o700, True), (0o775, False),
                                                (0o757, False), (0o777, False)])
async def test_a_directory_others_can_write_to_is_not_used(
    tmp_path: Path, sockets: list[socket.socket], mode: int, trusted: bool
) -> None:
    sink = MemoryAuditSink()
    directory = PluginDirectory(AuditLog(sink), lambda: 0.1)
    where = tmp_path / "plugins"
    where.mkdir()
    sockets.append(listening(where / "alpha.sock"))
    try:
        assert [p.name for p in await directory.scan(str(where), reserved=())] == ["alpha"]
        where.chmod(mode)
        found = await directory.scan(str(where), reserved=())
        assert [p.name for p in found] == (["alpha"] if trusted else [])
        if not trusted:
            assert sink.named("eviction_plugin_dropped")[-1]["reason"] == (
                f"directory refused: writable by its group or others (mode {mode:o})")
            # Made safe again: the plugin is used again.
            where.chmod(0o755)
            assert [p.name for p in await directory.scan(str(where), reserved=())] == ["alpha"]
    finally:
        await directory.close()


async def test_a_directory_behind_a_symbolic_link_is_not_used(
    tmp_path: Path, sockets: list[socket.socket]
) -> None:
    directory = PluginDirectory(AuditLog(MemoryAuditSink()), lambda: 0.1)
    (tmp_path / "real").mkdir()
    sockets.append(listening(tmp_path / "real" / "alpha.sock"))
    (tmp_path / "plugins").symlink_to(tmp_path / "real")
    try:
        assert await directory.scan(str(tmp_path / "plugins"), reserved=()) == []
    finally:
        await directory.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user")
async def test_a_directory_of_another_user_is_not_used(
    tmp_path: Path, sockets: list[socket.socket]
) -> None:
    directory = PluginDirectory(AuditLog(MemoryAuditSink()), lambda: 0.1)
    where = tmp_path / "plugins"
    where.mkdir()
    sockets.append(listening(where / "alpha.sock"))
    os.chown(where, 65534, 65534)
    try:
        assert await directory.scan(str(where), reserved=()) == []
    finally:
        await directory.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a socket to another user")
async def test_the_socket_owner_is_checked_again_right_before_a_call(
    tmp_path: Path, sockets: list[socket.socket]
) -> None:
    directory = PluginDirectory(AuditLog(MemoryAuditSink()), lambda: 0.1)
    path = tmp_path / "alpha.sock"
    sockets.append(listening(path))
    try:
        (plugin,) = await directory.scan(str(tmp_path), reserved=())
        # Someone else's socket under the listed name, before the agent connects.
        os.chown(path, 65534, 65534)
        with pytest.raises(PluginCallError) as caught:
            await plugin.threshold_met()
        assert (caught.value.kind, caught.value.detail) == (
            "refused", "owned by uid 65534, not root or the agent's user")
        # Swapped for another socket: refused until the directory is listed again.
        sockets[0].close()
        path.unlink()
        sockets.append(listening(path))
        with pytest.raises(PluginCallError) as caught:
            await plugin.threshold_met()
        assert (caught.value.kind, caught.value.detail) == (
            "refused", "the socket was replaced since it was listed")
        path.unlink()
        with pytest.raises(PluginCallError) as caught:
            await plugin.threshold_met()
        assert caught.value.kind == "unavailable"
    finally:
        await directory.close()


async def test_a_plugin_listing_thousands_of_uids_writes_a_bounded_audit_trail(
    tmp_path: Path
) -> None:
    env = make_env(tmp_path, None)
    env.add_pod("a")
    env.system.evict = EvictPods(tuple(
        EvictRequest(f"no-such-{i}", "spam", None, True) for i in range(10_000)))
    await env.round()
    assert len(env.sink.named("eviction_candidate")) == MAX_AUDITED_PROPOSALS
    assert len(env.sink.named("eviction_filtered")) == MAX_AUDITED_PROPOSALS
    (capped,) = env.sink.named("eviction_proposals_capped")
    assert (capped["plugin"], capped["proposals"], capped["omitted"]) == (
        "system_pressure", 10_000, 10_000 - MAX_AUDITED_PROPOSALS)
    # Exactly at the bound: every proposal audited, nothing capped.
    env2 = make_env(tmp_path / "2", None)
    env2.system.evict = EvictPods(tuple(
        EvictRequest(f"no-such-{i}", "spam", None, True)
        for i in range(MAX_AUDITED_PROPOSALS)))
    await env2.round()
    assert len(env2.sink.named("eviction_candidate")) == MAX_AUDITED_PROPOSALS
    assert env2.sink.named("eviction_proposals_capped") == []


# ---- real plugin processes ----------------------------------------------------------------------


async def test_plugin_processes_good_hung_crashing_and_garbage(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    # a deadline longer than the crashing plugin's wait before it dies
    call_s = 0.6
    env = make_env(tmp_path, fake, call_timeout_s=call_s, met_rounds=1, rate_burst=10,
                   plugin_dir=str(plugins))
    env.add_pod("small", anon=GIB, fake=fake)
    env.add_pod("big", anon=4 * GIB, priority=5, fake=fake)
    env.add_pod("online", level="shared_cores", anon=8 * GIB, fake=fake)
    record = tmp_path / "requests.jsonl"
    async with (
        plugin_process(plugins / "good.sock", "normal", "--met", "hard", "--condition",
                       "ExamplePressure", "--evict", f"{env.uid('online')}",
                       "--record", str(record)),
        plugin_process(plugins / "hung.sock", "hang"),
        plugin_process(plugins / "crashing.sock", "crash") as crashing,
        plugin_process(plugins / "garbage.sock", "garbage"),
    ):
        loop = asyncio.get_running_loop()
        started = loop.time()
        decisions = await env.round()
        # Two phases of calls, each at most a deadline long: the hung plugin costs no more.
        assert loop.time() - started < 2 * call_s + 1.4
        # The good plugin's hard-met target (the largest reclaimed pod) and its soft candidate.
        assert decisions == [("batch/big", "evicted"), ("batch/online", "evicted")]
        assert await asyncio.wait_for(crashing.wait(), 10) == 3
        failed = {(f["plugin"], f["call"]): f["kind"]
                  for f in env.sink.named("eviction_plugin_failed")}
        assert failed == {
            ("hung", "ThresholdMet"): "deadline", ("hung", "GetEvictPods"): "deadline",
            ("crashing", "GetEvictPods"): "unavailable",
            ("garbage", "ThresholdMet"): "invalid answer",
            ("garbage", "GetEvictPods"): "invalid answer",
        }
        assert {r["plugin"] for r in env.sink.named("eviction_plugin_registered")} == {
            "good", "hung", "crashing", "garbage"}
        assert fake.conditions("node-a")["ExamplePressure"]["status"] == "True"
        (chosen_big, _) = env.sink.named("eviction_chosen")
        assert chosen_big["plugin"] == "good"
        assert chosen_big["grace_s"] == 7
        assert chosen_big["reason"] == "threshold hard-met: example: 0.9 > 0.5"

        # What the plugin was sent: the facts of each running pod, nothing more.
        requests = [json.loads(line) for line in record.read_text().splitlines()]
        top = next(r["request"] for r in requests if r["call"] == "GetTopEvictionPods")
        assert top["top_n"] == 1
        assert top["eviction_scope"] == "example"
        pods = {p["name"]: p for p in top["active_pods"]}
        assert pods["big"] == {
            "uid": env.uid("big"), "namespace": "batch", "name": "big",
            "qos_level": "RECLAIMED_CORES", "priority": 5,
            "memory_request_bytes": str(GIB), "memory_usage_bytes": str(4 * GIB)}

        # The next round: the crashed plugin is unreachable (audited once), the others as
        # before; nothing is evicted twice.
        env.clock.now += 1
        assert await env.round() == [("batch/small", "evicted")]
        failed_again = env.sink.named("eviction_plugin_failed")
        assert ("crashing", "ThresholdMet", "unavailable") in {
            (f["plugin"], f["call"], f["kind"]) for f in failed_again}
        assert len(failed_again) == 6
        # A socket that disappears drops its plugin.
        (plugins / "hung.sock").unlink()
        env.clock.now += 1
        await env.round()
        assert "hung" in {r["plugin"] for r in env.sink.named("eviction_plugin_dropped")}
    await env.manager.close()
    evictions = [r.path for r in fake.requests("POST") if r.path.endswith("/eviction")]
    assert sorted(evictions) == sorted(
        f"/api/v1/namespaces/batch/pods/{name}/eviction" for name in ("big", "online", "small"))




def test_evict_pods_answer_size_limit() -> None:
    from reconciler.eviction.remote import MAX_ANSWER_PODS

    many = [pb.EvictPod(uid=f"u{i}") for i in range(MAX_ANSWER_PODS)]
    assert len(evict_pods_from(pb.GetEvictPodsResponse(evict_pods=many)).pods) == MAX_ANSWER_PODS
    many.append(pb.EvictPod(uid="one-more"))
    with pytest.raises(PluginCallError, match=f"{MAX_ANSWER_PODS + 1} pods"):
        evict_pods_from(pb.GetEvictPodsResponse(evict_pods=many))
