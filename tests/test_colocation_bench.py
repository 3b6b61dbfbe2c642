"""The building blocks of ``bench/colocation.py``: the kubelet-shaped node on this machine's
cgroups (made, used, removed, and swept after a run that was killed), the two workloads, the
runtime's handling of an NRI answer, and the summary line. No timing is checked here: the
numbers are the benchmark's business. The kernel tests are skipped without root and a memory
controller."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.baselines import (
    MODES,
    block_order,
    bootstrap_interval,
    memory_high,
    modes_for,
    quantile,
    static_limits,
)
from bench.colocation import WORKLOADS
from bench.colocation_agent import apply_adjustment
from bench.colocation_plan import Repetition
from bench.colocation_report import final_line, percentile, read_latencies, read_progress
from bench.kubelet_node import (
    CGROUP,
    GIB,
    MIB,
    PREFIX,
    KubeletNode,
    kubelet_oom_score_adj,
    shares_to_weight,
    sweep,
    unavailable,
)
from protos import nri_api_pb2 as api


def kernel(test: Any) -> Any:
    """A test of the real kernel: here, and once more in a cgroup v1 guest."""
    return pytest.mark.real_kernel(pytest.mark.skipif(
        bool(unavailable()), reason=unavailable() or "available")(test))
UID = "0c010c01-0000-4000-8000-0000000000fe"


def memcg_of(pid: int) -> str:
    """The process's cgroup in the memory hierarchy (v1 line, else the v2 one)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    found = [line.split(":", 2)[2] for line in lines if line.split(":")[1] == "memory"]
    return found[0] if found else next(line.split(":", 2)[2] for line in lines
                                       if line.startswith("0::"))


@kernel
def test_a_node_is_laid_out_as_kubelet_does_and_removed_with_its_processes(
        tmp_path: Path) -> None:
    node = KubeletNode("colocunit", 256 * MIB, 64 * MIB, 2)
    made = [node.memory, *(p for p in (node.cpu, node.psi) if p is not None)]
    try:
        assert node.limit_hits("kubepods") == 0
        limit = "memory.max" if node.v2 else "memory.limit_in_bytes"
        assert int((node.memory / limit).read_text()) == 256 * MIB
        assert int((node.memory / "kubepods" / limit).read_text()) == 192 * MIB
        online = node.add_pod("burstable", UID, "c" * 64, memory_limit=128 * MIB,
                              cpu_request_milli=500)
        assert online.cgroups_path == f"/kubepods/burstable/pod{UID}/{'c' * 64}"
        for rel in (online.pod_rel, online.rel):
            assert int((node.memory / rel / limit).read_text()) == 128 * MIB
        if node.cpu is not None and not node.v2:
            assert (node.cpu / online.rel / "cpu.shares").read_text().strip() == "512"
        root = node.agent_root(tmp_path)
        memory_link = root / "sys/fs/cgroup" / ("" if node.v2 else "memory")
        assert (memory_link / "kubepods/burstable").is_dir()
        assert (root / "proc/self").exists()
        process = node.spawn(online.rel, [sys.executable, "-c",
                                          "import sys; b = bytearray(32 << 20); print('up'); "
                                          "sys.stdout.flush(); sys.stdin.readline()"],
                             oom_score_adj=900)
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "up"
        assert memcg_of(process.pid).endswith(online.rel)
        assert Path(f"/proc/{process.pid}/oom_score_adj").read_text().strip() == "900"
        assert node.usage(online.rel) >= 32 * MIB  # charged where it runs
        assert node.stat(online.rel)["total_rss" if not node.v2 else "anon"] >= 32 * MIB
        if node.psi is not None:
            assert node.stall_us(online.rel, "memory") is not None
        # a node daemon beside kubepods, keeping the oom_score_adj it inherits
        daemon = node.add_system("agent")
        assert daemon == "system/agent"
        own = Path("/proc/self/oom_score_adj").read_text().strip()
        ran = subprocess.run(node.inside(daemon, ["cat", "/proc/self/cgroup",
                                                  "/proc/self/oom_score_adj"], None),
                             capture_output=True, text=True, check=True)
        assert f"{node.name}/system/agent\n" in ran.stdout
        assert ran.stdout.endswith(f"\n{own}\n")
    finally:
        node.close()
    assert process.poll() is not None
    assert not any(path.exists() for path in made)
    node.close()  # twice: nothing left to do


@kernel
def test_a_node_larger_than_4_gib_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 4096 MiB"):
        KubeletNode("colocunit", 4 * GIB + MIB, 0, 2)
    name = f"{PREFIX}colocunit-{os.getpid()}"
    assert not (CGROUP / name).exists()
    assert not (CGROUP / "memory" / name).exists()


@kernel
def test_sweep_removes_what_a_killed_run_left(tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    # the cgroups of a run whose process is gone (its pid is free again)
    node = KubeletNode("colocsweep", 128 * MIB, 0, 1)
    leftovers = [node.memory, *(p for p in (node.cpu, node.psi) if p is not None)]
    renamed = [p.with_name(f"{PREFIX}colocsweep-{child.pid}") for p in leftovers]
    node.close()
    for path in renamed:
        path.mkdir()
        (path / "kubepods").mkdir()
    mine = KubeletNode("colocsweep", 128 * MIB, 0, 1)  # a live run is left alone
    try:
        removed = sweep("colocsweep")
        assert sorted(map(str, removed)) == sorted(
            str(p) for path in renamed for p in (path / "kubepods", path))
        assert mine.memory.is_dir()
    finally:
        mine.close()


@kernel
def test_the_workloads_record_latency_and_progress(tmp_path: Path) -> None:
    files = tmp_path / "online"
    files.mkdir()
    for name in ("a", "b"):
        (files / name).write_bytes(b"\x01" * (1 * MIB))
    (tmp_path / "input").write_bytes(b"\x02" * (4 * MIB))
    node = KubeletNode("colocunit", 512 * MIB, 64 * MIB, 2)
    try:
        online = node.add_pod("burstable", UID, "d" * 64, memory_limit=None,
                              cpu_request_milli=100)
        offline = node.add_pod("besteffort", UID.replace("fe", "fd"), "e" * 64,
                               memory_limit=None, cpu_request_milli=0)
        on = node.spawn(online.rel, [sys.executable, "-I", str(WORKLOADS), "online", "--files",
                                     str(files), "--anon-mib", "2", "--reads", "2",
                                     "--out", str(tmp_path / "online.bin")], oom_score_adj=500)
        assert on.stdout is not None
        assert on.stdout.readline().strip() == "ready"
        off = node.spawn(offline.rel, [
            sys.executable, "-I", str(WORKLOADS), "offline", "--input", str(tmp_path / "input"),
            "--output", str(tmp_path / "output"), "--output-mib", "2", "--anon-mib", "8",
            "--grow-mib-s", "1000", "--task-s", "0.1", "--write-every", "2",
            "--out", str(tmp_path / "offline.txt")], oom_score_adj=1000)
        # until the offline job has reported some progress (four times a second)
        report = tmp_path / "offline.txt"
        deadline = time.monotonic() + 10
        while len(report.read_text().splitlines() if report.exists() else []) < 2:
            assert off.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.05)
        node.stop(off)
        node.stop(on)
        assert (on.returncode, off.returncode) == (0, 0)
    finally:
        node.close()
    samples = read_latencies(tmp_path / "online.bin")
    assert samples
    assert all(duration > 0 for _, duration in samples)
    progress = read_progress(tmp_path / "offline.txt", 0, 1 << 62)
    assert progress[0] == (0.0, 0.0)
    assert progress[-1][1] > 0
    assert (tmp_path / "output").stat().st_size <= 2 * MIB


@kernel
def test_the_runtime_applies_the_answer_and_kubelet_values_stand_otherwise() -> None:
    node = KubeletNode("colocunit", 256 * MIB, 0, 1)
    try:
        ctr = node.add_pod("besteffort", UID, "f" * 64, memory_limit=None, cpu_request_milli=0)
        assert apply_adjustment(node, ctr, api.ContainerAdjustment(), 834) == (834, [])
        adjust = api.ContainerAdjustment()
        adjust.linux.oom_score_adj.value = 1000
        adjust.linux.resources.memory.limit.value = 64 * MIB
        oom, applied = apply_adjustment(node, ctr, adjust, 834)
        assert oom == 1000
        assert applied[:2] == ["oom_score_adj=1000", f"memory limit={64 * MIB}"]
        limit = "memory.max" if node.v2 else "memory.limit_in_bytes"
        assert int((node.memory / ctr.rel / limit).read_text()) == 64 * MIB
        if not node.v2:
            adjust.linux.resources.unified["memory.high"] = "1000"
            assert apply_adjustment(node, ctr, adjust, 834)[1][-1] == (
                "memory.high=1000 (not applied: cgroup v1)")
    finally:
        node.close()


def test_kubelet_formulas() -> None:
    assert kubelet_oom_score_adj(512 * MIB, 3 * GIB, "burstable") == 834
    assert kubelet_oom_score_adj(0, 3 * GIB, "burstable") == 999
    assert kubelet_oom_score_adj(3 * GIB, 3 * GIB, "burstable") == 2
    assert kubelet_oom_score_adj(0, 3 * GIB, "besteffort") == 1000
    assert kubelet_oom_score_adj(GIB, 3 * GIB, "guaranteed") == -997
    assert shares_to_weight(2) == 1
    assert shares_to_weight(1024) == 39
    assert shares_to_weight(262144) == 10000


def rep(mode: str, latencies: list[float], mb: float) -> Repetition:
    return Repetition(mode=mode, index=1, latencies_ms=latencies, alone_ms=[],
                      progress=[(0.0, 0.0), (1.0, mb)], indicators={}, actions={}, events=[],
                      adjustments=[], problems=[])


def test_the_last_line() -> None:
    reps = [rep("agent", [1.0] * 100, 800.0), rep("unmanaged", [float(v) for v in range(1, 101)],
                                                     900.0),
            rep("agent", [2.0] * 100, 1000.0), rep("static", [3.0] * 100, 700.0)]
    # modes in their fixed order, those not run left out
    assert final_line(reps) == (
        "online p99 ms: unmanaged=99.01 static=3.00 agent=2.00; offline MiB: unmanaged=900 "
        "static=700 agent=900")
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([], 0.99) != percentile([], 0.99)  # NaN: nothing measured


# -- the baselines and the method (bench/baselines.py) -----------------------------------------

def test_modes_on_each_cgroup_version() -> None:
    assert modes_for(list(MODES), v2=True) == MODES
    assert modes_for(["agent", "unmanaged", "kubelet-memoryqos"], v2=False) == (
        "unmanaged", "agent")
    with pytest.raises(ValueError, match="unknown mode"):
        modes_for(["managed"], v2=True)


def test_qos_reserved_limits_the_tiers_as_kubelet_does() -> None:
    # allocatable 2816 MiB, a Burstable pod requesting 512 MiB, no Guaranteed pod
    assert static_limits(2816 * MIB, 512 * MIB, 0) == {
        "kubepods/besteffort": 2304 * MIB, "kubepods/burstable": 2816 * MIB}
    assert static_limits(2816 * MIB, 512 * MIB, 256 * MIB, 50) == {
        "kubepods/besteffort": 2432 * MIB, "kubepods/burstable": 2688 * MIB}
    assert static_limits(GIB, 2 * GIB, 0)["kubepods/besteffort"] == 0  # never negative


def test_memory_qos_high_as_kubelet_computes_it() -> None:
    # request 512 MiB, limit 1 GiB: 512 + 0.9 x 512 MiB = 972.8 MiB, down to a page
    assert memory_high(512 * MIB, GIB, 2816 * MIB) == int(972.8 * MIB) // 4096 * 4096
    # no limit: node allocatable in its place; a BestEffort container (request 0)
    assert memory_high(0, None, 2816 * MIB) == int(0.9 * 2816 * MIB) // 4096 * 4096
    assert memory_high(0, None, 4096 * 10) == 4096 * 9


def test_blocks_hold_every_mode_once_in_a_seeded_order() -> None:
    order = block_order(MODES, 4, seed=7)
    assert len(order) == 20
    for block in range(4):
        assert sorted(m for m, b in order if b == block) == sorted(MODES)
    assert order == block_order(MODES, 4, seed=7)  # the printed seed repeats a run
    assert order != block_order(MODES, 4, seed=8)
    # not one fixed order: the first place goes to more than one mode over the blocks
    assert len({next(m for m, b in order if b == block) for block in range(4)}) > 1


def test_bootstrap_interval() -> None:
    values = [10.0, 11.0, 12.0, 13.0, 30.0]
    low, high = bootstrap_interval(values, lambda v: sorted(v)[len(v) // 2], seed=1)
    assert min(values) <= low <= 12.0 <= high <= max(values)
    assert bootstrap_interval([5.0] * 4, lambda v: sum(v) / len(v), seed=1) == (5.0, 5.0)
    nothing = bootstrap_interval([], lambda v: 0.0, seed=1)
    assert nothing[0] != nothing[0]  # NaN
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
