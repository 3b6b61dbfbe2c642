"""The building blocks of ``bench/colocation.py``: the kubelet-shaped node on this machine's
cgroups (made, used, removed, and swept after a run that was killed), the two workloads, the
runtime's handling of an NRI answer, and the summary line. No timing is checked here: the
numbers are the benchmark's business. The kernel tests are skipped without root and a memory
controller."""

from __future__ import annotations

import array
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.baselines import (
    ALONE,
    MODES,
    block_order,
    in_order,
    memory_high,
    modes_for,
    static_limits,
)
from bench.colocation_agent import apply_adjustment
from bench.colocation_cli import list_scenarios, node_mib_for, parser, settings_from
from bench.colocation_machine import describe, machine_facts
from bench.colocation_plan import (
    INTERPRETER_MIB,
    OFFLINE_PODS,
    SCENARIOS,
    Repetition,
    anon_peak_mib,
    default_input_mib,
    offline_plans,
    online_held_mib,
)
from bench.colocation_report import (
    applied_lines,
    as_json,
    final_line,
    from_json,
    merge_progress,
    per_request_ms,
    percentile,
    read_progress,
    read_service,
    read_work,
    rep_line,
    rep_p99,
    service_rows,
    tail_percentile,
)
from bench.colocation_workloads import MISS, arrival_ns, count_misses
from bench.kubelet_node import (
    CGROUP,
    GIB,
    MIB,
    PREFIX,
    KubeletNode,
    kubelet_oom_score_adj,
    shares_to_weight,
    sweep,
)
from protos import nri_api_pb2 as api
from tests.support.colocation import kernel

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
        # v1 has no memory.high to go over
        assert node.throttle_hits("kubepods") == (0 if node.v2 else None)
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
        peak = node.peak(online.rel)
        assert peak is not None
        assert peak >= 32 * MIB
        assert node.peak("no/such/cgroup") is None
        if node.psi is not None:
            assert node.stall_us(online.rel, "memory") is not None
        # a node daemon in its pod, keeping the oom_score_adj it inherits
        daemon = node.add_pod("burstable", "d43m0n00-0000-4000-8000-000000000001", "agent",
                              memory_limit=256 * MIB, cpu_request_milli=50)
        own = Path("/proc/self/oom_score_adj").read_text().strip()
        ran = subprocess.run(node.inside(daemon.rel, ["cat", "/proc/self/cgroup",
                                                      "/proc/self/oom_score_adj"], None),
                             capture_output=True, text=True, check=True)
        assert f"{node.name}/{daemon.rel}\n" in ran.stdout
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


def test_the_online_pod_alone_runs_only_when_named_first_and_with_no_offline_pod() -> None:
    assert ALONE not in MODES
    assert modes_for(["agent", ALONE], v2=False) == (ALONE, "agent")
    assert in_order(["agent", ALONE, "unmanaged"]) == [ALONE, "unmanaged", "agent"]
    default = parser("").parse_args([]).modes.split(",")
    assert tuple(default) == MODES
    assert offline_plans(ALONE, 2) == ()
    assert offline_plans("unmanaged", 2) == OFFLINE_PODS
    assert offline_plans("agent", 1) == OFFLINE_PODS[:1]
    reps = [rep(ALONE, [1.0] * 100, 0.0), rep("unmanaged", [2.0] * 100, 900.0)]
    assert final_line(reps) == (
        "online p99 ms: alone=1.00 unmanaged=2.00; offline MiB: alone=0 unmanaged=900")


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


# -- the online service, the offline work, the scenarios ------------------------------------------

def test_open_loop_arrivals_are_fixed_by_the_rate_not_by_the_answers() -> None:
    assert [arrival_ns(1_000, 200.0, i) for i in range(4)] == [
        1_000, 5_001_000, 10_001_000, 15_001_000]
    assert arrival_ns(0, 3.0, 1) == 333_333_333
    assert count_misses([1, 5, MISS, 2_000_000_000, 1_000_000_000], 1_000_000_000) == 2


def test_service_percentiles_count_misses_as_infinitely_late(tmp_path: Path) -> None:
    assert tail_percentile([1.0, 2.0, 3.0, 4.0], 0, 0.5) == 2.0
    assert tail_percentile([float(v) for v in range(1, 101)], 0, 0.99) == 99.0
    # one miss in 100 requests: p99 still answered, p99.9 reaches the miss
    assert tail_percentile([float(v) for v in range(1, 100)], 1, 0.99) == 99.0
    assert tail_percentile([float(v) for v in range(1, 100)], 1, 0.999) == math.inf
    assert tail_percentile([], 3, 0.5) == math.inf
    assert math.isnan(tail_percentile([], 0, 0.5))
    # the records: (due ns, latency ns), -1 for no answer; only those due in the window count,
    # an answer later than the timeout is a miss
    records = array.array("q", [5, 1_000_000, 10, 2_000_000, 20, MISS, 30, 3_000_000_000,
                                40, 4_000_000])
    path = tmp_path / "service.bin"
    path.write_bytes(records.tobytes())
    assert read_service(path, 10, 40, 1000.0) == ([2.0], 2)
    assert read_service(tmp_path / "none.bin", 0, 1, 1000.0) == ([], 0)


def test_a_mode_reports_the_service_p99_when_the_service_ran() -> None:
    probe_only = rep("unmanaged", [1.0] * 100, 10.0)
    served = rep("agent", [1.0] * 100, 10.0)
    served.service_ms = [float(v) for v in range(1, 100)]
    served.service_missed = 1
    assert rep_p99(probe_only) == 1.0
    assert rep_p99(served) == 99.0
    assert final_line([probe_only, served]) == (
        "online p99 ms: unmanaged=1.00 agent=99.00; offline MiB: unmanaged=10 agent=10")
    served.service_missed = 5
    assert final_line([served]).startswith("online p99 ms: agent=inf;")


def test_offline_work_and_progress_of_several_pods(tmp_path: Path) -> None:
    report = tmp_path / "offline.txt"
    report.write_text(f"100 {MIB} 0 0 {MIB} 2000000\n200 {4 * MIB} {MIB} 0 {4 * MIB} 9000000\n"
                      f"900 {8 * MIB} {MIB} 0 {8 * MIB} 20000000\n")
    assert read_work(report, 500) == (4.0, 0.009)
    assert read_progress(report, 0, 500) == [(0.0, 0.0), (1e-7, 1.0), (2e-7, 5.0)]
    merged = merge_progress([[(0.0, 0.0), (1.0, 10.0), (3.0, 30.0)],
                             [(0.0, 0.0), (2.0, 5.0)]])
    assert merged == [(0.0, 0.0), (1.0, 10.0), (2.0, 15.0), (3.0, 35.0)]


def test_the_offline_data_set_fits_unmanaged_and_not_squeezed() -> None:
    held = online_held_mib(64, 256, service=True)
    assert held == 64 * 2 + 256 + 2 * INTERPRETER_MIB
    assert anon_peak_mib(2048, 1024.0, 6.0, 90.0) == 2048
    assert anon_peak_mib(2560, 32.0, 1e9, 20.0) == 640  # grows for the whole window only
    size, room = default_input_mib(2816, held, 2048, 1, 0.8)
    assert room == 2816 - held - 2048 - INTERPRETER_MIB
    assert size == int(0.8 * room) < room
    # what kubelet's static cap leaves the offline tier (allocatable - 512 MiB of requests)
    # holds its anonymous peak, not the data set as well
    assert size + 2048 > 2816 - 512
    assert default_input_mib(1024, 900, 512, 2, 0.8)[0] == 128  # never below 64 MiB a pod


def args_for(*argv: str) -> Any:
    return parser("test").parse_args(list(argv))


def test_every_scenario_makes_settings() -> None:
    for name, scenario in SCENARIOS.items():
        machine = scenario.node_mib * 95 // 100 if scenario.whole_machine else 23 * 1024
        settings, how = settings_from(args_for("--scenario", name, "--quick"), machine, v2=True)
        assert settings.scenario == name
        assert settings.offline_pods == scenario.offline_pods
        assert settings.node_mib == (machine if scenario.whole_machine else scenario.node_mib)
        assert settings.offline_input_mib >= 64
        assert f"offline data set {settings.offline_input_mib} MiB" in how
    streaming, how = settings_from(args_for("--scenario", "streaming"), 3900, v2=False)
    assert streaming.offline_anon_mib == 0
    assert streaming.offline_warm
    assert [n for n, s in SCENARIOS.items() if s.warm] == ["streaming"]
    cold, _ = settings_from(args_for("--scenario", "streaming", "--no-offline-warm"), 3900,
                            v2=False)
    assert not cold.offline_warm
    warm, _ = settings_from(args_for("--offline-warm"), 23 * 1024, v2=False)
    assert warm.offline_warm
    assert "does not fit even unmanaged" in how
    held, how = settings_from(args_for("--scenario", "held-anon"), 3900, v2=True)
    assert (held.offline_input_mib, held.offline_anon_mib) == (400, 3000)
    assert held.online_files_mib == 640
    assert "400 MiB (the scenario's)" in how
    assert "does not fit even unmanaged" in how
    given, how = settings_from(args_for("--offline-input-mib", "500", "--online-rps", "0"),
                               23 * 1024, v2=False)
    assert (given.offline_input_mib, given.online_rps, given.offline_warm) == (500, 0.0, False)
    assert "kubelet-memoryqos" not in given.modes
    assert "(given)" in how
    assert "node-8g" in list_scenarios()


def test_a_whole_machine_scenario_needs_a_machine_of_its_size() -> None:
    assert node_mib_for(SCENARIOS["node-4g"], 3900) == 3900
    assert node_mib_for(SCENARIOS["main"], 23 * 1024) == 3072
    with pytest.raises(ValueError, match=r"python -m tests\.vm --mem-mib 8192"):
        node_mib_for(SCENARIOS["node-8g"], 23 * 1024)
    with pytest.raises(ValueError, match="about 4096 MiB"):
        node_mib_for(SCENARIOS["node-4g"], 2048)


def test_the_json_carries_the_service_and_the_work_and_reads_back() -> None:
    served = rep("agent", [1.0] * 10, 10.0)
    served.service_ms, served.service_missed = [2.0] * 9, 1
    served.work_mib, served.work_cpu_s, served.agent_cpu_s = 8.0, 0.5, 1.25
    settings, _ = settings_from(args_for("--quick", "--seed", "3"), 23 * 1024, v2=False)
    text = as_json([served], settings, {"kernel": "k"})
    found = json.loads(text)["summary"]["agent"]
    assert found["agent_cpu_s"] == 1.25
    assert found["service_ms"]["p50"] == 2.0
    assert found["service_ms"]["p99.9"] == math.inf
    assert (found["service_requests"], found["service_missed"]) == (10, 1)
    assert (found["work_mib"], found["work_cpu_s"]) == (8.0, 0.5)
    reps, again, machine = from_json(text)
    assert reps == [served]
    assert again == settings
    assert machine == {"kernel": "k"}
    assert service_rows(reps)[0][2:7] == ["10", "2.00", "inf", "inf", "1"]
    assert service_rows(reps)[0][7:9] == ["-", "-"]  # no scheduler statistics read
    assert service_rows(reps)[0][-1] == "1.2"  # the agent's CPU seconds


def test_the_service_time_on_and_waiting_for_a_cpu_is_per_request_sent() -> None:
    first, second, quiet = rep("agent", [1.0], 1.0), rep("agent", [1.0], 1.0), rep("alone", [],
                                                                                   0.0)
    first.service_ms, first.service_missed = [2.0] * 8, 2  # 10 requests, the missed counted
    first.indicators = {"service_run_ns": 30_000_000, "service_wait_ns": 5_000_000}
    second.service_ms = [2.0] * 5
    second.indicators = {"service_run_ns": 5_000_000, "service_wait_ns": None}
    quiet.indicators = {"service_run_ns": 1_000_000, "service_wait_ns": 0}  # no request sent
    assert per_request_ms(first, "service_run_ns") == 3.0
    assert per_request_ms(second, "service_wait_ns") is None
    assert per_request_ms(quiet, "service_run_ns") is None
    rows = service_rows([first, second])
    assert rows[0][7:9] == ["3.000", "0.500"]
    assert rows[-1][:2] == ["agent", "all"]
    assert rows[-1][7:9] == ["2.000", "0.500"]  # means of the repetitions that have one


def test_a_repetitions_line_says_the_agents_cpu_only_where_an_agent_ran() -> None:
    alone = rep("static", [1.0] * 10, 10.0)
    assert rep_line(alone).endswith("agent: -")
    managed = rep("agent", [1.0] * 10, 10.0)
    managed.agent_cpu_s = 2.56
    assert rep_line(managed).endswith("agent: -, 2.6 CPU s")


def test_what_each_mode_applied_at_creation_is_said_per_mode() -> None:
    reps = [rep("unmanaged", [1.0], 1.0), rep("kubelet-memoryqos", [1.0], 1.0),
            rep("agent", [1.0], 1.0), rep("agent", [1.0], 1.0)]
    reps[1].adjustments = ["web-0: memory.min=512"]
    reps[2].adjustments = ["web-0: memory.low=512", "etl-0: oom_score_adj=1000"]
    reps[3].adjustments = ["web-0: memory.low=512"]
    assert applied_lines(reps) == [
        "kubelet-memoryqos applied at creation (kubelet's values): web-0: memory.min=512",
        "agent applied at creation (its CreateContainer answers): etl-0: oom_score_adj=1000; "
        "web-0: memory.low=512"]


def test_the_machine_facts_say_how_fast_it_runs_python_and_grows_memory() -> None:
    facts = machine_facts("v2", 3)
    assert set(facts) == {"kernel", "cpus", "memory", "cgroup", "loop", "touch"}
    assert facts["cpus"] == "3"
    for key in ("loop", "touch"):
        number, unit = facts[key].split()
        assert unit == "ms"
        assert float(number) > 0
    line = describe(facts)
    assert f"takes {facts['loop']}, touching 256 MiB of new memory {facts['touch']}" in line
