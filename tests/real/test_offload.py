"""Offloading on a real cgroup v2 kernel: the loop frees an offline pod's cold page cache step by
step and leaves an online pod's alone; a cgroup removed as its step starts, or while the kernel
reclaims from it, is forgotten; a step that outlasts its deadline is killed.

Page cache comes from files on the guest's scratch ext4 disk (tmpfs pages are not file cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bench.kubelet_node import remove_cgroup
from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.model import ContainerInfo
from nri_plugin.config.schema import Config
from nri_plugin.report.features import evaluate, kubernetes_feature
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.loops.offload_loop import OffloadLoop
from reconciler.metrics import ReconcilerMetrics
from tests.support.builders import claiming_pod
from tests.support.guest_node import MIB, Node, memory_stat

pytestmark = pytest.mark.vm(numa=2, mem_mib=2048)

OFFLINE = "0ff10ad0-0000-4000-8000-000000000001"
ONLINE = "0ff10ad0-0000-4000-8000-000000000002"
OFFLINE_ID = "f" * 64
ONLINE_ID = "e" * 64


def config(**offload: Any) -> Config:
    base = Config()
    return dataclasses.replace(base, offload=dataclasses.replace(
        base.offload, enabled=True, **offload))


def loop_for(cfg: Config, state: NodeState, sysfs: SysFs | None = None
             ) -> tuple[OffloadLoop, MemoryAuditSink, ReconcilerMetrics]:
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = sysfs if sysfs is not None else SysFs("/", audit)
    host = probe_host(sysfs)
    assert host.cgroup.v2
    assert host.memcg.reclaim
    metrics = ReconcilerMetrics()
    return OffloadLoop(lambda: cfg, state, sysfs, host, audit, metrics=metrics), sink, metrics


def test_the_offline_pods_cold_cache_goes_step_by_step_the_online_pods_stays(
        node: Node, tmp_path: Path) -> None:
    offline, offline_path = node.container("besteffort", OFFLINE, OFFLINE_ID)
    online, online_path = node.container("burstable", ONLINE, ONLINE_ID)
    for cgroup, name in ((offline, "offline"), (online, "online")):
        worker = node.worker(cgroup, cgroup)
        assert worker.ask(f"write {tmp_path / name}.bin 256") == {"written_mib": 256}
        worker.kill()  # the cache is cold: nobody reads it again
    state = NodeState()
    state.replace_all(
        [claiming_pod(OFFLINE, "besteffort", "reclaimed_cores"),
         claiming_pod(ONLINE, "burstable", "shared_cores")],
        [ContainerInfo(id=OFFLINE_ID, pod_sandbox_id=f"sb-{OFFLINE}", name="c",
                       cgroups_path=offline_path),
         ContainerInfo(id=ONLINE_ID, pod_sandbox_id=f"sb-{ONLINE}", name="c",
                       cgroups_path=online_path)])
    offline_before = memory_stat(offline)["file"]
    online_before = memory_stat(online)["file"]
    assert offline_before >= 250 * MIB
    # the deadline is not what this test is about: a step on a busy TCG machine has taken 5 s
    loop, sink, metrics = loop_for(config(max_bytes_per_s=1 << 30, step_timeout_s=60.0), state)
    files = [offline_before]
    for _ in range(6):
        loop.cycle(time.monotonic())
        files.append(memory_stat(offline)["file"])
        time.sleep(0.2)
    steps = sink.named("offload_step")
    assert [s["result"] for s in steps] == ["done"] * 5, steps
    assert {s["pod_uid"] for s in steps} == {OFFLINE}
    # 5 %, then 15 %, 25 %, 35 %, 45 % of what is left: the kernel gave all each step asked
    assert [s["percent"] for s in steps] == [5.0, 15.0, 25.0, 35.0, 45.0], steps
    assert [s["verdict"] for s in steps] == ["grow"] + ["fast_grow"] * 4
    for step in steps:
        assert step["reclaimed_bytes"] >= step["asked_bytes"] * 0.9, step
    # every step after the first cycle took cache away
    assert all(after < before for before, after in itertools.pairwise(files[1:])), files
    given_back = offline_before - files[-1]
    assert given_back >= 0.6 * offline_before, files
    assert memory_stat(online)["file"] >= online_before - 4 * MIB
    assert metrics.registry.get_sample_value(
        "nri_qos_offload_reclaimed_bytes_total",
        {"pod_uid": OFFLINE, "namespace": "test", "pod": "reclaimed_cores"}) == sum(
        s["reclaimed_bytes"] for s in steps)


class RemovedAsItStarts(SysFs):
    """The container's cgroup is removed (its processes gone) the moment its step starts."""

    def __init__(self, node: Node, cgroup: Path, audit: AuditLog) -> None:
        super().__init__("/", audit)
        self._node = node
        self._cgroup = cgroup

    def write_bounded(self, path: str, value: str, timeout_s: float,
                      nice: int = 0) -> tuple[Outcome, str]:
        self._node.kill_processes()
        assert remove_cgroup(self._cgroup, within_s=30.0), f"{self._cgroup} could not be removed"
        return super().write_bounded(path, value, timeout_s, nice)


def test_a_cgroup_removed_as_its_step_starts_is_forgotten(node: Node, tmp_path: Path) -> None:
    cgroup, cgroups_path = node.container("besteffort", OFFLINE, OFFLINE_ID)
    worker = node.worker(cgroup, cgroup)
    worker.ask(f"write {tmp_path / 'cold.bin'} 64")
    state = NodeState()
    state.replace_all([claiming_pod(OFFLINE, "besteffort", "reclaimed_cores")],
                      [ContainerInfo(id=OFFLINE_ID, pod_sandbox_id=f"sb-{OFFLINE}", name="c",
                                     cgroups_path=cgroups_path)])
    removing = RemovedAsItStarts(node, cgroup, AuditLog(MemoryAuditSink()))
    # The step's writer is a child process, whose start alone can take seconds in a slow
    # guest: a timeout far above it, so that only the cgroup's absence can end the step.
    loop, sink, _ = loop_for(config(step_timeout_s=60.0), state, removing)
    loop.cycle(time.monotonic())
    loop.cycle(time.monotonic() + 1)
    [step] = sink.named("offload_step")
    assert step["result"] == "gone", step
    assert not cgroup.exists()
    loop.cycle(time.monotonic() + 2)  # the container's files are gone: nothing, no error
    assert len(sink.named("offload_step")) == 1


def writer() -> int | None:
    """The child of this process that has a memory.reclaim open (a writer in the kernel)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                # pid (comm) state ppid ...: comm may hold spaces, the fields after it do not.
                if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and reclaiming(
                        int(entry)):
                    return int(entry)
    return None


def reclaiming(pid: int) -> bool:
    """Whether ``pid`` still has a memory.reclaim open: one process's fds, read at once."""
    with contextlib.suppress(OSError):
        return any(os.readlink(fd).endswith("/memory.reclaim")
                   for fd in Path(f"/proc/{pid}/fd").iterdir())
    return False


def test_a_cgroup_removed_while_its_step_reclaims(node: Node, tmp_path: Path) -> None:
    """The container's processes end and its cgroup is removed while the kernel is reclaiming
    1.5 GiB from it: Linux 6.1 finishes the step on the removed cgroup and the write succeeds;
    what it reclaimed cannot be read any more (the cgroup's memory.stat went with it), and the
    container is forgotten at the next cycle."""
    cgroup, cgroups_path = node.container("besteffort", OFFLINE, OFFLINE_ID)
    worker = node.worker(cgroup, cgroup)
    worker.ask(f"write {tmp_path / 'big.bin'} 1536")
    state = NodeState()
    state.replace_all([claiming_pod(OFFLINE, "besteffort", "reclaimed_cores")],
                      [ContainerInfo(id=OFFLINE_ID, pod_sandbox_id=f"sb-{OFFLINE}", name="c",
                                     cgroups_path=cgroups_path)])
    cfg = config(initial_percent=100.0, max_step_percent=100.0, max_step_bytes=4 << 30,
                 max_bytes_per_s=4 << 30, step_timeout_s=60.0)
    loop, sink, _ = loop_for(cfg, state)
    loop.cycle(0.0)
    removed_during: list[bool] = []

    def remove() -> None:
        deadline = time.monotonic() + 30
        pid = writer()
        while pid is None and time.monotonic() < deadline:
            time.sleep(0.001)
            pid = writer()
        node.kill_processes()
        while time.monotonic() < deadline:
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.005)
        # Asked of the writer found before, not by scanning /proc again: under TCG a scan takes
        # long enough for the writer to finish meanwhile.
        removed_during.append(pid is not None and reclaiming(pid))

    remover = threading.Thread(target=remove)
    remover.start()
    started = time.monotonic()
    loop.cycle(5.0)  # a whole period's budget: the step asks for all 1.5 GiB
    remover.join(60)
    [step] = sink.named("offload_step")
    assert removed_during == [True], step  # the cgroup went while the writer was reclaiming
    assert not cgroup.exists()
    assert step["result"] == "done", step
    assert step["asked_bytes"] >= 1 << 30, step
    assert step["reclaimed_bytes"] is None, step
    assert time.monotonic() - started < 30, step
    loop.cycle(10.0)  # its files are gone: nothing, no error
    assert len(sink.named("offload_step")) == 1


def test_a_step_longer_than_its_deadline_is_killed(node: Node, tmp_path: Path) -> None:
    """The pod holds 1.5 GiB of page cache and reads a file over and over while its step asks
    for all of its inactive cache, so the kernel is still reclaiming at the deadline of 0.3 s:
    the writer is killed and the step audited as a timeout."""
    cgroup, cgroups_path = node.container("besteffort", OFFLINE, OFFLINE_ID)
    worker = node.worker(cgroup, cgroup)
    data = tmp_path / "data.bin"
    worker.ask(f"write {tmp_path / 'big.bin'} 1536")
    worker.ask(f"write {data} 64")
    state = NodeState()
    state.replace_all([claiming_pod(OFFLINE, "besteffort", "reclaimed_cores")],
                      [ContainerInfo(id=OFFLINE_ID, pod_sandbox_id=f"sb-{OFFLINE}", name="c",
                                     cgroups_path=cgroups_path)])
    cfg = config(initial_percent=100.0, max_step_percent=100.0, max_step_bytes=4 << 30,
                 max_bytes_per_s=4 << 30, step_timeout_s=0.3, max_stall_percent=100.0,
                 min_accuracy_percent=0.0)
    loop, sink, _ = loop_for(cfg, state)
    loop.cycle(time.monotonic())
    # No limit of the pod is hit, so ``read`` would go on for the worker's REACH_S: the worker
    # is killed once the step has ended.
    def read() -> None:
        with contextlib.suppress(RuntimeError):
            worker.ask(f"read {data} 6")

    reading = threading.Thread(target=read, daemon=True)
    reading.start()
    time.sleep(0.5)  # the reader is refilling the cache
    loop.cycle(time.monotonic())
    worker.kill()
    reading.join(10)
    [step] = sink.named("offload_step")
    assert step["result"] == "timeout", step
    assert 0.3 <= step["duration_s"] < 2.0, step
    assert step["asked_bytes"] >= 1 << 30, step


def test_probe_of_a_node_without_swap_offloads_file_cache_only() -> None:
    cfg = config()
    host = probe_host(SysFs("/"))
    assert host.swap_total_bytes == 0
    found = evaluate(cfg, host, kubernetes_feature(cfg, None, ""))["reconciler.offload"]
    assert found.runs
    assert "file cache only: the node has no swap" in found.detail
