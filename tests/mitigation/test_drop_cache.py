"""Drop cache on fake v1 and v2 trees: who is chosen, what is written, timeouts, failures, one
drop per pod, never an online pod, dry-run, and the audit records."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.detection.pods import PodIndex, PodMemory
from reconciler.detection.signals import Level
from reconciler.host.parse import ParseError
from reconciler.host.probe import HostInfo, probe_host
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.metrics import ReconcilerMetrics
from reconciler.mitigation.actions import Cause
from reconciler.mitigation.drop_cache import Candidate, DropCacheAction, page_cache, plan
from tests.support.fakesys import MIB, FakeHost, FakePod
from tests.support.paths import KERNEL_FIXTURES, REPO
from tests.support.polling import eventually
from tests.support.processes import alive, children_of

LEVEL = "qos.nri-qos.io/level"
CAUSE = Cause(Level.MEDIUM)


class Tree:
    def __init__(self, root: Path, version: int, **drop: Any) -> None:
        self.host = FakeHost(root, version=version,
                             driver="systemd" if version == 2 else "cgroupfs")
        self.v2 = version == 2
        self.file = "memory.reclaim" if self.v2 else "memory.force_empty"
        (self.host.tier_dir("guaranteed") / self.file).write_text("")
        self.pods: dict[str, FakePod] = {}
        cfg = Config()
        self.cfg = dataclasses.replace(cfg, mitigation=dataclasses.replace(
            cfg.mitigation, drop_cache=dataclasses.replace(cfg.mitigation.drop_cache, **drop)))
        self.sink = MemoryAuditSink()
        self.sysfs = SysFs(root, AuditLog(self.sink))
        self.state = NodeState()
        self.metrics = ReconcilerMetrics()

    def pod(self, name: str, level: str, cache: int, *, tier: str = "besteffort") -> Path:
        uid = f"{name}-0000-4000-8000-000000000000"
        pod = self.host.add_pod(uid, tier=tier, name=name, annotations={LEVEL: level})
        self.pods[name] = pod
        d = self.host.cg("memory", self.host.pod_rel(tier, uid))
        stat = f"anon {MIB}\nfile {cache}\n" if self.v2 else (
            f"cache 0\nrss 0\ntotal_cache {cache}\ntotal_rss {MIB}\n")
        (d / "memory.stat").write_text(stat)
        (d / ("memory.current" if self.v2 else "memory.usage_in_bytes")).write_text(
            f"{cache + MIB}\n")
        (d / self.file).write_text("")
        return d

    def action(self) -> tuple[DropCacheAction, HostInfo]:
        self.state.replace_all(*self.host.nri())
        host = probe_host(self.sysfs)
        action = DropCacheAction(lambda: self.cfg, self.sysfs, host,
                                 PodIndex(self.state, host.cgroup), AuditLog(self.sink),
                                 metrics=self.metrics)
        return action, host


@pytest.fixture
def v2(tmp_path: Path) -> Tree:
    return Tree(tmp_path, 2)


async def test_reclaimed_pods_largest_cache_first_on_v2(v2: Tree) -> None:
    big = v2.pod("big", "reclaimed_cores", 300 * MIB)
    small = v2.pod("small", "reclaimed_cores", 100 * MIB)
    tiny = v2.pod("tiny", "reclaimed_cores", 16 * MIB - 1)  # just under min_cache_bytes
    online = v2.pod("online", "shared_cores", 900 * MIB, tier="burstable")
    action, _ = v2.action()
    result = await action.engage(CAUSE, dry_run=False)
    action.close()
    assert result.result == "done", result
    assert (big / "memory.reclaim").read_text() == str(300 * MIB)
    assert (small / "memory.reclaim").read_text() == str(100 * MIB)
    assert (tiny / "memory.reclaim").read_text() == ""
    assert (online / "memory.reclaim").read_text() == ""
    started = v2.sink.named("drop_cache_started")
    assert sorted(r["pod"] for r in started) == ["default/big", "default/small"]
    finished = {r["path"]: r for r in v2.sink.named("drop_cache_finished")}
    record = finished[f"/sys/fs/cgroup/{v2.host.pod_rel('besteffort', v2.pods['big'].info.uid)}"
                      "/memory.reclaim"]
    assert record["result"] == "done"
    assert record["usage_before_bytes"] == record["usage_after_bytes"] == 301 * MIB
    assert record["freed_bytes"] == 0
    assert record["duration_s"] >= 0
    assert [r["reason"] for r in started] == [CAUSE.text()] * 2
    assert sorted(r["usage_before_bytes"] for r in started) == [101 * MIB, 301 * MIB]


async def test_amount_is_capped_and_pods_per_round_limited(tmp_path: Path) -> None:
    tree = Tree(tmp_path, 2, reclaim_bytes=64 * MIB, max_pods=1)
    big = tree.pod("big", "reclaimed_cores", 300 * MIB)
    small = tree.pod("small", "reclaimed_cores", 100 * MIB)
    action, _ = tree.action()
    await action.engage(CAUSE, dry_run=False)
    action.close()
    assert (big / "memory.reclaim").read_text() == str(64 * MIB)
    assert (small / "memory.reclaim").read_text() == ""


async def test_v1_force_empty(tmp_path: Path) -> None:
    tree = Tree(tmp_path, 1)
    d = tree.pod("batch", "reclaimed_cores", 200 * MIB)
    action, _ = tree.action()
    result = await action.engage(CAUSE, dry_run=False)
    action.close()
    assert result.result == "done"
    assert (d / "memory.force_empty").read_text() == "0"
    [started] = tree.sink.named("drop_cache_started")
    assert started["path"].endswith("/memory/kubepods/besteffort/pod"
                                    f"{tree.pods['batch'].info.uid}/memory.force_empty")
    assert started["cache_bytes"] == 200 * MIB


async def test_dry_run_writes_nothing(v2: Tree) -> None:
    d = v2.pod("big", "reclaimed_cores", 300 * MIB)
    action, _ = v2.action()
    result = await action.engage(CAUSE, dry_run=True)
    action.close()
    assert result.result == "dry_run"
    assert "default/big" in result.detail
    assert (d / "memory.reclaim").read_text() == ""
    assert v2.sink.records == []


async def test_a_write_that_hangs_is_killed_and_stalls_no_other_pod(tmp_path: Path) -> None:
    tree = Tree(tmp_path, 2, timeout_s=0.5)
    stuck = tree.pod("stuck", "reclaimed_cores", 300 * MIB)
    fine = tree.pod("fine", "reclaimed_cores", 100 * MIB)
    (stuck / "memory.reclaim").unlink()
    os.mkfifo(stuck / "memory.reclaim")  # opening it for writing blocks: a write that hangs
    action, _ = tree.action()
    result = await asyncio.wait_for(action.engage(CAUSE, dry_run=False), 10)
    action.close()
    assert result.result == "failed"  # one timed out, one done
    assert "timeout" in result.detail
    by_pod = {r["pod_uid"]: r for r in tree.sink.named("drop_cache_finished")}
    assert by_pod[tree.pods["stuck"].info.uid]["result"] == "timeout"
    assert by_pod[tree.pods["stuck"].info.uid]["duration_s"] >= 0.5
    assert by_pod[tree.pods["fine"].info.uid]["result"] == "done"
    assert (fine / "memory.reclaim").read_text() == str(100 * MIB)
    assert action.busy() == frozenset()
    runs = {result: tree.metrics.registry.get_sample_value(
        "nri_qos_drop_cache_runs_total", {"result": result}) for result in ("done", "timeout")}
    assert runs == {"done": 1.0, "timeout": 1.0}


async def test_a_refused_write_is_audited_with_its_error(v2: Tree) -> None:
    d = v2.pod("odd", "reclaimed_cores", 300 * MIB)
    (d / "memory.reclaim").unlink()
    (d / "memory.reclaim").mkdir()  # EISDIR: a write the kernel refuses
    action, _ = v2.action()
    result = await action.engage(CAUSE, dry_run=False)
    action.close()
    assert result.result == "failed"
    [finished] = v2.sink.named("drop_cache_finished")
    assert finished["result"] == "failed"
    assert finished["error"] == "EISDIR: Is a directory"


async def test_a_reclaim_the_kernel_makes_short_is_done_not_failed(
        v2: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    d = v2.pod("shm", "reclaimed_cores", 300 * MIB)
    action, _ = v2.action()

    def short(path: str, value: str, timeout_s: float, nice: int = 0) -> tuple[Outcome, str]:
        (v2.host.root / path.lstrip("/")).parent.joinpath("memory.current").write_text(
            f"{200 * MIB + MIB}\n")  # 100 MiB of the 300 went
        return Outcome.FAILED, "EAGAIN: Resource temporarily unavailable"

    monkeypatch.setattr(v2.sysfs, "write_bounded", short)
    result = await action.engage(CAUSE, dry_run=False)
    action.close()
    # what could go went: the ladder does not try again at once
    assert result.result == "done"
    assert result.detail.endswith("1 short of the amount asked")
    [finished] = v2.sink.named("drop_cache_finished")
    assert (finished["result"], finished["freed_bytes"]) == ("short", 100 * MIB)
    assert finished["path"].endswith(f"{d.name}/memory.reclaim")
    assert v2.metrics.registry.get_sample_value("nri_qos_drop_cache_runs_total",
                                                {"result": "short"}) == 1.0


async def test_eagain_from_force_empty_is_a_failure(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    v1 = Tree(tmp_path, 1)
    v1.pod("old", "reclaimed_cores", 300 * MIB)
    action, _ = v1.action()
    monkeypatch.setattr(v1.sysfs, "write_bounded",
                        lambda *_a, **_k: (Outcome.FAILED, "EAGAIN: Resource temporarily "
                                                          "unavailable"))
    result = await action.engage(CAUSE, dry_run=False)
    action.close()
    assert result.result == "failed"  # v1's force_empty promises no amount: nothing is short


async def test_a_pod_gone_meanwhile_is_skipped(v2: Tree) -> None:
    d = v2.pod("gone", "reclaimed_cores", 300 * MIB)
    action, _ = v2.action()
    candidates = await asyncio.to_thread(action.candidates)
    (d / "memory.reclaim").unlink()
    drop = await asyncio.to_thread(action.drop, candidates[0], v2.cfg.mitigation.drop_cache, "x")
    action.close()
    assert drop.result == "skipped"
    assert v2.sink.named("drop_cache_finished")[0]["error"] == "ENOENT: No such file or directory"


async def test_a_pod_gone_meanwhile_does_not_fail_the_round(v2: Tree) -> None:
    """A pod that left between the plan and its write had nothing to drop: the round is done,
    not failed (a failed engage is tried again after the retry backoff, 1 s, which would drop
    the other pods' cache again long before repeat_s)."""
    gone = v2.pod("gone", "reclaimed_cores", 300 * MIB)
    big = v2.pod("big", "reclaimed_cores", 200 * MIB)
    (gone / "memory.reclaim").unlink()
    action, _ = v2.action()
    result = await action.engage(CAUSE, dry_run=False)
    action.close()
    assert (big / "memory.reclaim").read_text() == str(200 * MIB)
    assert sorted(r["result"] for r in v2.sink.named("drop_cache_finished")) == [
        "done", "skipped"]
    assert result.result == "done", result


async def test_a_retry_drops_only_what_failed_and_a_repeat_everything_again(v2: Tree) -> None:
    """The ladder retries a failed round after its backoff (from 1 s): the pods whose cache
    went stay as they are until repeat_s, when every pod's cache may go again."""
    odd = v2.pod("odd", "reclaimed_cores", 300 * MIB)
    big = v2.pod("big", "reclaimed_cores", 200 * MIB)
    (odd / "memory.reclaim").unlink()
    (odd / "memory.reclaim").mkdir()  # EISDIR: a write the kernel refuses
    action, _ = v2.action()

    def attempts() -> list[str]:
        return sorted(r["pod_uid"][:3] for r in v2.sink.named("drop_cache_finished"))

    assert (await action.engage(CAUSE, dry_run=False)).result == "failed"
    assert attempts() == ["big", "odd"]
    (big / "memory.reclaim").write_text("")
    assert (await action.engage(CAUSE, dry_run=False)).result == "failed"
    assert attempts() == ["big", "odd", "odd"]
    assert (big / "memory.reclaim").read_text() == ""
    await action.repeat(CAUSE, dry_run=False)
    action.close()
    assert attempts() == ["big", "big", "odd", "odd", "odd"]
    assert (big / "memory.reclaim").read_text() == str(200 * MIB)


async def test_at_most_one_drop_per_pod(tmp_path: Path) -> None:
    tree = Tree(tmp_path, 2, timeout_s=1.0)
    stuck = tree.pod("stuck", "reclaimed_cores", 300 * MIB)
    other = tree.pod("other", "reclaimed_cores", 100 * MIB)
    (stuck / "memory.reclaim").unlink()
    os.mkfifo(stuck / "memory.reclaim")
    action, _ = tree.action()
    first = asyncio.create_task(action.engage(CAUSE, dry_run=False))
    uid = tree.pods["stuck"].info.uid
    await eventually(lambda: uid in action.busy())
    # a second round while the first still runs: the stuck pod is not asked again
    (other / "memory.reclaim").write_text("")
    await action.engage(CAUSE, dry_run=False)
    started = [r["pod_uid"] for r in tree.sink.named("drop_cache_started")]
    assert started.count(uid) == 1
    await first
    action.close()


def test_never_an_online_pod() -> None:
    def candidate(level: str, cache: int, uid: str) -> Candidate:
        return Candidate(PodMemory(uid, f"ns/{uid}", level, f"/sys/fs/cgroup/{uid}", 0, {}),
                         cache)

    rung = Config().mitigation.drop_cache
    pods = [candidate(level, 10**9, level) for level in
            ("dedicated_cores", "shared_cores", "system_cores")]
    assert plan([*pods, candidate("reclaimed_cores", 10**9, "r")], rung) == [
        candidate("reclaimed_cores", 10**9, "r")]
    # exactly min_cache_bytes is enough; ties go by uid; busy pods wait
    edge = [candidate("reclaimed_cores", rung.min_cache_bytes, "b"),
            candidate("reclaimed_cores", rung.min_cache_bytes, "a")]
    assert [c.pod.uid for c in plan(edge, rung)] == ["a", "b"]
    assert [c.pod.uid for c in plan(edge, rung, frozenset({"a"}))] == ["b"]


async def test_drop_refuses_an_online_pod_even_if_asked(v2: Tree) -> None:
    d = v2.pod("online", "dedicated_cores", 300 * MIB, tier="guaranteed")
    action, _ = v2.action()
    pod = PodMemory("u", "ns/online", "dedicated_cores",
                    f"/sys/fs/cgroup/{v2.host.pod_rel('guaranteed', v2.pods['online'].info.uid)}",
                    0, {})
    drop = await asyncio.to_thread(action.drop, Candidate(pod, 300 * MIB),
                                   v2.cfg.mitigation.drop_cache, "x")
    action.close()
    assert drop.result == "skipped"
    assert (d / "memory.reclaim").read_text() == ""
    assert v2.sink.records == []


async def test_unavailable_without_the_kernel_file(tmp_path: Path) -> None:
    tree = Tree(tmp_path, 2)
    (tree.host.tier_dir("guaranteed") / "memory.reclaim").unlink()
    tree.pod("big", "reclaimed_cores", 300 * MIB)
    action, host = tree.action()
    assert not host.memcg.reclaim
    result = await action.engage(CAUSE, dry_run=False)
    action.close()
    assert (result.result, result.detail) == ("skipped",
                                              "the kernel has no memory.reclaim (Linux 5.19+)")


async def test_nothing_to_drop(v2: Tree) -> None:
    v2.pod("tiny", "reclaimed_cores", MIB)
    action, _ = v2.action()
    result = await action.engage(CAUSE, dry_run=False)
    assert result.result == "unchanged"
    assert (await action.release(CAUSE, dry_run=False)).result == "unchanged"
    action.close()


def test_page_cache_of_each_version() -> None:
    fixtures = KERNEL_FIXTURES
    assert page_cache((fixtures / "v1_pod_memory.stat").read_text(), v2=False) == 25165824
    assert page_cache((fixtures / "v2_pod_memory.stat").read_text(), v2=True) == 201326592
    assert page_cache("cache 7\nrss 1\n", v2=False) == 7
    with pytest.raises(ParseError, match="lacks file"):
        page_cache("anon 5\n", v2=True)


def test_pod_names_from_the_runtime_are_bounded(v2: Tree) -> None:
    v2.pod("x" * 40, "reclaimed_cores", 300 * MIB)
    long_name = v2.pods["x" * 40].info
    v2.host.pods[0].info = dataclasses.replace(long_name, name="n" * 500)
    v2.state.replace_all(*v2.host.nri())
    [pod] = PodIndex(v2.state, probe_host(v2.sysfs).cgroup).pods()
    assert len(pod.name) < 200
    assert "(508 chars, sha256" in pod.name


# -- stopping -------------------------------------------------------------------------------------

async def test_a_running_drop_is_killed_not_waited_for_when_the_agent_stops(
        tmp_path: Path) -> None:
    tree = Tree(tmp_path, 2, timeout_s=60)
    stuck = tree.pod("stuck", "reclaimed_cores", 300 * MIB)
    (stuck / "memory.reclaim").unlink()
    os.mkfifo(stuck / "memory.reclaim")
    action, _ = tree.action()
    engaged = asyncio.create_task(action.engage(CAUSE, dry_run=False))
    await eventually(lambda: bool(tree.sink.named("drop_cache_started")))
    await eventually(lambda: bool(children_of(os.getpid())))
    started = asyncio.get_running_loop().time()
    action.close()
    result = await asyncio.wait_for(engaged, 10)
    assert asyncio.get_running_loop().time() - started < 5  # not the 60 s timeout
    assert result.result == "failed"
    (finished,) = tree.sink.named("drop_cache_finished")
    assert finished["error"] == "the writer was killed: the agent is stopping"
    assert children_of(os.getpid()) == []
    # Nothing new starts once stopping.
    assert tree.sysfs.write_bounded("/sys/fs/cgroup/x", "0", 1.0) == (
        Outcome.FAILED, "not started: the agent is stopping")


HELPER = """
import sys
from reconciler.host.sysfs import Outcome, SysFs
print(SysFs(sys.argv[1]).write_bounded(sys.argv[2], "1", 60.0), flush=True)
"""


def holds_within(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_drop_writer_dies_with_the_agent(tmp_path: Path) -> None:
    """An agent killed outright (SIGKILL, OOM) takes its writers with it: none goes on making
    the kernel reclaim for a process that is gone."""
    fifo = tmp_path / "sys/fs/cgroup/pod/memory.reclaim"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    agent = subprocess.Popen([sys.executable, "-c", HELPER, str(tmp_path),
                              "/sys/fs/cgroup/pod/memory.reclaim"],
                             cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        assert holds_within(lambda: bool(children_of(agent.pid)), 20)
        (writer,) = children_of(agent.pid)
        agent.kill()
        agent.wait()
        assert holds_within(lambda: not alive(writer), 10)
    finally:
        agent.kill()
        agent.wait()
