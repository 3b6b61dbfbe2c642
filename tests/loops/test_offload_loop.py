"""The offload loop on fake cgroup trees: who is offloaded, the node's budget, the ladder, dry-run,
observe mode, cgroup v1, metrics, and the child that writes the step."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from nri_plugin.report.features import evaluate, kubernetes_feature
from reconciler.host.probe import HostInfo, probe_host
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.host.values import PAGE_SIZE
from reconciler.loops.offload import FAST_GROW, offload_problem
from reconciler.loops.offload_loop import OffloadLoop
from reconciler.metrics import ReconcilerMetrics
from tests.support.builders import LEVEL
from tests.support.fakesys import MIB, FakeHost, FakePod
from tests.support.offload import GIB, INACTIVE, PRESSURE, pages, stat_text
from tests.support.processes import children_of

# -- the loop on a fake tree ---------------------------------------------------------------------


class KernelSysFs(SysFs):
    """A fake kernel behind memory.reclaim: a write takes what it asks from inactive_file and
    counts it in pgsteal, as the kernel does when the cache is cold."""

    def write_bounded(self, path: str, value: str, timeout_s: float,
                      nice: int = 0) -> tuple[Outcome, str]:
        outcome, error = super().write_bounded(path, value, timeout_s, nice)
        if outcome is Outcome.WRITTEN:
            stat = Path(self.real(path.rsplit("/", 1)[0] + "/memory.stat"))
            values = dict(line.split() for line in stat.read_text().splitlines())
            taken = min(int(value), int(values["inactive_file"]))
            values["inactive_file"] = str(int(values["inactive_file"]) - taken)
            values["file"] = str(int(values["file"]) - taken)
            values["pgsteal"] = str(int(values["pgsteal"]) + taken // PAGE_SIZE)
            values["pgscan"] = str(int(values["pgscan"]) + taken // PAGE_SIZE)
            stat.write_text("".join(f"{k} {v}\n" for k, v in values.items()))
        return outcome, error


class Node:
    def __init__(self, root: Path, *, version: int = 2, observe: bool = False,
                 **offload: Any) -> None:
        self.host = FakeHost(root, version=version,
                             driver="systemd" if version == 2 else "cgroupfs")
        if version == 2:
            (self.host.tier_dir("guaranteed") / "memory.reclaim").write_text("")
        (root / "proc/meminfo").write_text("MemTotal: 4194304 kB\nSwapTotal: 0 kB\n")
        cfg = Config()
        self.cfg = dataclasses.replace(cfg, offload=dataclasses.replace(
            cfg.offload, enabled=True, **offload))
        self.sink = MemoryAuditSink()
        self.audit = AuditLog(self.sink)
        sysfs = KernelSysFs(root, self.audit)
        self.sysfs = sysfs.observing(lambda: observe) if observe else sysfs
        self.state = NodeState()
        self.engaged = False
        self.metrics = ReconcilerMetrics()
        self.hostinfo: HostInfo = probe_host(sysfs)
        self.loop = OffloadLoop(lambda: self.cfg, self.state, self.sysfs, self.hostinfo,
                                self.audit, ladder_engaged=lambda: self.engaged,
                                metrics=self.metrics)

    def pod(self, name: str, level: str, *, tier: str = "besteffort",
            annotations: dict[str, str] | None = None, containers: int = 1,
            inactive: int = INACTIVE) -> FakePod:
        uid = f"{name}-0000-4000-8000-000000000000"
        pod = self.host.add_pod(uid, tier=tier, name=name, containers=containers,
                                annotations={LEVEL: level, **(annotations or {})})
        for container in pod.containers:
            d = self.host.cg("memory", container.rel)
            (d / "memory.stat").write_text(stat_text(file=inactive, ifile=inactive))
            (d / "memory.pressure").write_text(PRESSURE.format(some=0))
            (d / "memory.reclaim").write_text("")
        self.state.replace_all(*self.host.nri())
        return pod

    def reclaim_file(self, pod: FakePod, index: int = 0) -> str:
        return (self.host.cg("memory", pod.containers[index].rel)
                / "memory.reclaim").read_text()


def test_an_offline_container_is_offloaded_step_by_step_an_online_one_never(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    offline = node.pod("offline", "reclaimed_cores")
    online = node.pod("online", "shared_cores", tier="burstable")
    node.loop.cycle(0.0)
    assert node.reclaim_file(offline) == ""
    assert node.sink.named("offload_step") == []
    node.loop.cycle(5.0)
    assert node.reclaim_file(offline) == str(pages(50 * MIB))  # 5 % of 1000 MiB
    node.loop.cycle(10.0)
    # the fake kernel gave all: 15 % of the 950 MiB left
    assert node.reclaim_file(offline) == str(pages(int(0.15 * 950 * MIB)))
    assert node.reclaim_file(online) == ""
    steps = node.sink.named("offload_step")
    assert [s["result"] for s in steps] == ["done", "done"]
    assert steps[0]["asked_bytes"] == pages(50 * MIB)
    assert steps[0]["reclaimed_bytes"] == pages(50 * MIB)
    assert steps[0]["file_freed_bytes"] == pages(50 * MIB)
    assert steps[1]["verdict"] == FAST_GROW
    assert {s["pod_uid"] for s in steps} == {offline.info.uid}
    text = node.metrics.registry.get_sample_value(
        "nri_qos_offload_reclaimed_bytes_total",
        {"pod_uid": offline.info.uid, "namespace": "default", "pod": "offline"})
    assert text == steps[0]["reclaimed_bytes"] + steps[1]["reclaimed_bytes"]


def test_a_shared_cores_pod_needs_the_setting_and_the_annotation(tmp_path: Path) -> None:
    node = Node(tmp_path)
    opted = node.pod("opted", "shared_cores", tier="burstable",
                     annotations={"nri-qos.io/offload": "true"})
    for now in (0.0, 5.0):
        node.loop.cycle(now)
    assert node.reclaim_file(opted) == ""
    node.cfg = dataclasses.replace(node.cfg, offload=dataclasses.replace(
        node.cfg.offload, shared_cores=True))
    for now in (10.0, 15.0):
        node.loop.cycle(now)
    assert node.reclaim_file(opted) == str(pages(50 * MIB))


def test_the_node_budget_bounds_the_cycle_across_containers(tmp_path: Path) -> None:
    node = Node(tmp_path, max_bytes_per_s=10 * MIB, interval_s=5.0)
    pod = node.pod("offline", "reclaimed_cores", containers=2)
    node.loop.cycle(0.0)
    node.loop.cycle(5.0)  # each asks 50 MiB; 50 MiB in all
    asked = [s["asked_bytes"] for s in node.sink.named("offload_step")]
    assert sorted(asked) == [50 * MIB]
    assert sorted([node.reclaim_file(pod, 0), node.reclaim_file(pod, 1)]) == [
        "", str(50 * MIB)]
    node.loop.cycle(7.0)  # 2 s later: 20 MiB
    assert sum(s["asked_bytes"] for s in node.sink.named("offload_step")[1:]) == 20 * MIB


def test_nothing_while_the_ladder_is_engaged_and_the_baselines_start_over(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = node.pod("offline", "reclaimed_cores")
    node.loop.cycle(0.0)
    node.engaged = True
    node.loop.cycle(5.0)
    node.loop.cycle(10.0)
    assert node.reclaim_file(pod) == ""
    assert [r["reason"] for r in node.sink.named("offload_paused")] == [
        "the mitigation ladder is engaged"]
    node.engaged = False
    node.loop.cycle(15.0)  # a first cycle again
    assert node.reclaim_file(pod) == ""
    assert len(node.sink.named("offload_resumed")) == 1
    node.loop.cycle(20.0)
    assert node.reclaim_file(pod) == str(pages(50 * MIB))


def test_dry_run_audits_the_step_and_writes_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path, dry_run=True)
    pod = node.pod("offline", "reclaimed_cores")
    node.loop.cycle(0.0)
    node.loop.cycle(5.0)
    assert node.reclaim_file(pod) == ""
    [step] = node.sink.named("offload_step")
    assert (step["result"], step["dry_run"], step["asked_bytes"]) == (
        "dry_run", True, pages(50 * MIB))


def test_observe_mode_holds_the_write_like_every_other_loops(tmp_path: Path) -> None:
    node = Node(tmp_path, observe=True)
    pod = node.pod("offline", "reclaimed_cores")
    node.loop.cycle(0.0)
    node.loop.cycle(5.0)
    assert node.reclaim_file(pod) == ""
    assert node.sink.named("offload_step")[0]["result"] == "observed"
    assert node.sink.named("write_observed")[0]["path"].endswith("/memory.reclaim")


def test_a_container_gone_mid_step_is_forgotten(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = node.pod("offline", "reclaimed_cores")
    node.loop.cycle(0.0)
    (node.host.cg("memory", pod.containers[0].rel) / "memory.reclaim").unlink()
    node.loop.cycle(5.0)
    assert node.sink.named("offload_step")[0]["result"] == "gone"


def test_cgroup_v1_is_off_and_says_why(tmp_path: Path) -> None:
    node = Node(tmp_path, version=1)
    node.pod("offline", "reclaimed_cores")
    assert node.loop.problem == "cgroup v1 has no memory.reclaim (offloading needs cgroup v2)"
    node.loop.cycle(0.0)
    node.loop.cycle(5.0)
    assert node.sink.named("offload_step") == []
    features = evaluate(node.cfg, node.hostinfo, kubernetes_feature(node.cfg, None, ""))
    assert features["reconciler.offload"].runs is False
    assert features["reconciler.offload"].detail == node.loop.problem


def test_a_kernel_without_memory_reclaim_is_off(tmp_path: Path) -> None:
    node = Node(tmp_path)
    (node.host.tier_dir("guaranteed") / "memory.reclaim").unlink()
    assert offload_problem(probe_host(node.sysfs)) == \
        "the kernel has no memory.reclaim (Linux 5.19+)"


def feature(tmp_path: Path, swap_kib: int, **offload: Any) -> str:
    node = Node(tmp_path, **offload)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: 4194304 kB\nSwapTotal: {swap_kib} kB\n")
    found = evaluate(node.cfg, probe_host(node.sysfs), kubernetes_feature(node.cfg, None, ""))
    assert found["reconciler.offload"].runs
    return found["reconciler.offload"].detail


def test_probe_says_what_memory_goes_by_swap_and_setting(tmp_path: Path) -> None:
    assert "file cache only: the node has no swap" in feature(tmp_path / "a", 0, anon=True)
    both = feature(tmp_path / "b", 1 << 20, anon=True)
    assert "file cache and anonymous memory (swap of 1024 MiB" in both
    assert "memory.swap.max is 0" in both
    kept = feature(tmp_path / "c", 1 << 20)
    assert "steps bounded by inactive file memory" in kept
    assert "the kernel may still take some anonymous memory" in kept
    assert feature(tmp_path / "d", 0, dry_run=True).startswith("dry-run")


def test_off_by_default() -> None:
    assert Config().offload.enabled is False


def test_metrics_stall_after_a_step_refault_rate_and_gone_with_the_pod(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = node.pod("offline", "reclaimed_cores")
    labels = {"pod_uid": pod.info.uid, "namespace": "default", "pod": "offline"}
    cgroup = node.host.cg("memory", pod.containers[0].rel)
    node.loop.cycle(0.0)
    (cgroup / "memory.pressure").write_text(PRESSURE.format(some=3000))  # before any step
    node.loop.cycle(5.0)  # the first step
    assert node.metrics.registry.get_sample_value(
        "nri_qos_offload_stall_seconds_total", labels) == 0
    (cgroup / "memory.pressure").write_text(PRESSURE.format(some=13_000))
    stat = (cgroup / "memory.stat").read_text().replace(
        "workingset_refault_file 0", "workingset_refault_file 50")
    (cgroup / "memory.stat").write_text(stat)
    node.loop.cycle(10.0)
    get = node.metrics.registry.get_sample_value
    assert get("nri_qos_offload_stall_seconds_total", labels) == pytest.approx(0.01)
    assert get("nri_qos_offload_refaults_per_second", labels) == pytest.approx(10.0)
    node.host.remove_pod(pod)
    node.state.replace_all(*node.host.nri())
    node.loop.cycle(15.0)
    left = [sample for family in node.metrics.registry.collect()
            if family.name.startswith("nri_qos_offload") for sample in family.samples]
    assert left == []


def test_with_swap_a_container_whose_swap_max_is_zero_offloads_file_cache_only(
        tmp_path: Path) -> None:
    node = Node(tmp_path, anon=True)
    (tmp_path / "proc/meminfo").write_text("MemTotal: 4194304 kB\nSwapTotal: 1048576 kB\n")
    pod = node.pod("offline", "reclaimed_cores", containers=2, inactive=100 * MIB)
    for container, swap_max in zip(pod.containers, ("max\n", "0\n"), strict=True):
        d = node.host.cg("memory", container.rel)
        (d / "memory.stat").write_text(stat_text(file=100 * MIB, ifile=100 * MIB,
                                                 anon=GIB, ia=900 * MIB))
        (d / "memory.swap.max").write_text(swap_max)
    node.loop.cycle(0.0)
    node.loop.cycle(5.0)
    steps = {s["container"]: s for s in node.sink.named("offload_step")}
    assert (steps["c0"]["anon"], steps["c0"]["asked_bytes"]) == (True, pages(50 * MIB))
    assert (steps["c1"]["anon"], steps["c1"]["asked_bytes"]) == (False, pages(5 * MIB))


def test_the_step_is_written_by_a_child_at_niceness_19(tmp_path: Path) -> None:
    """The kernel reclaims in the writer's context: the writer yields the CPU to the pods."""
    node = Node(tmp_path)
    pod = node.pod("offline", "reclaimed_cores")
    reclaim = node.host.cg("memory", pod.containers[0].rel) / "memory.reclaim"
    reclaim.unlink()
    os.mkfifo(reclaim)  # the writer blocks in open() until the test reads
    node.loop.cycle(0.0)
    step = threading.Thread(target=node.loop.cycle, args=(5.0,))
    step.start()
    wanted = min(os.getpriority(os.PRIO_PROCESS, 0) + 19, 19)
    deadline = time.monotonic() + 30
    seen: list[int] = []
    while time.monotonic() < deadline and wanted not in seen:
        seen = []
        for pid in children_of(os.getpid()):
            with contextlib.suppress(OSError):
                seen.append(os.getpriority(os.PRIO_PROCESS, pid))
        time.sleep(0.02)
    with reclaim.open("rb") as fifo:
        written = fifo.read()
    step.join(30)
    assert wanted in seen
    assert written == str(pages(50 * MIB)).encode()
    assert node.sink.named("offload_step")[0]["result"] == "done"


def test_a_step_killed_at_its_deadline_halves_the_share(tmp_path: Path) -> None:
    node = Node(tmp_path, step_timeout_s=0.2)
    pod = node.pod("offline", "reclaimed_cores")
    reclaim = node.host.cg("memory", pod.containers[0].rel) / "memory.reclaim"
    reclaim.unlink()
    os.mkfifo(reclaim)  # nobody reads: the writer blocks until it is killed
    for now in (0.0, 5.0, 10.0):
        node.loop.cycle(now)
    steps = node.sink.named("offload_step")
    assert [s["result"] for s in steps] == ["timeout", "timeout"]
    # 5 %, halved to 2.5 %, then grown by 5 % (nothing came back: no faster growth)
    assert [s["percent"] for s in steps] == [5.0, 7.5]


@pytest.mark.real_kernel
def test_this_kernel_says_whether_it_can_offload() -> None:
    cfg = Config()
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, enabled=True))
    host = probe_host(SysFs("/"))
    found = evaluate(cfg, host, kubernetes_feature(cfg, None, ""))["reconciler.offload"]
    if not host.cgroup.v2:
        assert (found.runs, found.detail) == (
            False, "cgroup v1 has no memory.reclaim (offloading needs cgroup v2)")
    else:
        assert found.runs == host.memcg.reclaim
