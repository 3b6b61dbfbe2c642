"""The colocation benchmark's accounting of what the offline tier, the machine and the agent's
stand-ins paid, and of where the CPUs went (bench/colocation_report.py,
bench/colocation_agent.py, bench/colocation_budget.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

import pytest

from bench.colocation_agent import API_POLL_S
from bench.colocation_budget import budget_rows, party_pids, party_times, print_budget_table
from bench.colocation_cli import parser, settings_from
from bench.colocation_indicators import indicator_deltas, task_times_ns, vmstat
from bench.colocation_plan import Repetition
from bench.colocation_report import (
    actions_text,
    as_json,
    cost_rows,
    from_json,
    print_aligned,
    rep_line,
)
from tests.support.fake_apiserver import FakeApiServer, make_pod


def rep(mode: str, index: int = 1) -> Repetition:
    return Repetition(mode=mode, index=index, latencies_ms=[1.0] * 10, alone_ms=[],
                      progress=[(0.0, 0.0), (1.0, 10.0)], indicators={}, actions={}, events=[],
                      adjustments=[], problems=[])


def test_the_cost_table_says_what_the_offline_tier_and_the_machine_paid() -> None:
    agent = rep("agent")
    agent.indicators = {"offline_tier_hits": 3, "offline_tier_throttled": 5,
                        "offline_refault": 512, "offline_majfault": 7,
                        "offline_psi_memory_ms_s": 1.25, "offline_psi_io_ms_s": 40.0,
                        "kswapd_scan": 2560}
    agent.agent_mib, agent.agent_peak_mib, agent.bench_cpu_s = 61.2, 97.4, 1.5
    other = rep("agent", 2)
    other.indicators = {**agent.indicators, "offline_refault": 1536, "kswapd_scan": None}
    other.agent_mib, other.agent_peak_mib, other.bench_cpu_s = 64.8, 101.6, 2.5
    alone = rep("unmanaged")
    alone.indicators = {"offline_refault": 0}
    rows = cost_rows([agent, other, alone])
    # pages are MiB at 4 KiB a page; an unknown reading is left out of the mean
    assert rows[0] == ["agent", "1", "3", "5", "2", "7", "1.2", "40.0", "10", "61", "97", "1.5"]
    assert rows[2] == ["agent", "all", "3", "5", "4", "7", "1.2", "40.0", "10", "63", "100",
                       "2.0"]
    assert rows[4] == ["unmanaged", "all", "-", "-", "0", "-", "-", "-", "-", "-", "-", "-"]
    text = as_json([agent], *_settings_and_machine())
    assert json.loads(text)["summary"]["agent"]["agent_peak_mib"] == 97.4
    assert json.loads(text)["summary"]["agent"]["agent_mib"] == 61.2
    assert from_json(text)[0] == [agent]
    assert rep_line(agent).endswith("agent: -, 61 MiB at the end, peak 97 MiB")


def _settings_and_machine() -> tuple[Any, dict[str, str]]:
    args = parser("test").parse_args(["--quick", "--seed", "3"])
    settings, _ = settings_from(args, 23 * 1024, v2=False)
    return settings, {"kernel": "k"}


def test_the_api_server_stand_in_waking_seldom_still_answers_and_stops() -> None:
    server = FakeApiServer(poll_interval_s=API_POLL_S)
    with server:
        server.add_pod(make_pod("web-0"))
        with urllib.request.urlopen(f"{server.url}/api/v1/pods", timeout=5) as answer:
            names = [p["metadata"]["name"] for p in json.load(answer)["items"]]
    assert names == ["web-0"]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{server.url}/api/v1/pods", timeout=5)


def test_counters_become_rates_and_deltas() -> None:
    before: dict[str, int | None] = {"offline_refault": 10, "offline_psi_io_us": 1_000_000,
                                     "kswapd_scan": None}
    after: dict[str, int | None] = {"offline_refault": 30, "offline_psi_io_us": 3_000_000,
                                    "kswapd_scan": 5}
    # a stall becomes ms of stall per second of the window; an unknown end stays unknown
    assert indicator_deltas(before, after, 4.0) == {
        "offline_refault": 20, "offline_psi_io_ms_s": 500.0, "kswapd_scan": None}
    # a time on a CPU stays in ns (per request, the service's) and is also ms per second
    times: dict[str, int | None] = {"agent_run_ns": 1_000_000_000, "load_wait_ns": 0}
    assert indicator_deltas(times, {"agent_run_ns": 3_000_000_000, "load_wait_ns": None},
                            4.0) == {"agent_run_ns": 2_000_000_000, "agent_run_ms_s": 500.0,
                                     "load_wait_ns": None, "load_wait_ms_s": None}
    assert vmstat("pgscan_kswapd") is not None  # this kernel's /proc/vmstat
    assert vmstat("no_such_counter") is None


THREAD_SPINS = """
import threading, time
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_a_process_time_on_a_cpu_is_summed_over_its_threads() -> None:
    # The main thread sleeps; only a second thread runs: a reading of the process's first
    # thread alone would find next to nothing.
    child = subprocess.Popen([sys.executable, "-c", THREAD_SPINS], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        first = task_times_ns(child.pid)
        time.sleep(0.5)
        run, wait = task_times_ns(child.pid)
    finally:
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
    assert first[0] is not None
    assert run is not None
    assert wait is not None
    assert run - first[0] >= 200_000_000
    assert wait >= 0
    assert task_times_ns(child.pid) == (None, None)  # gone
    assert task_times_ns(None) == (None, None)


def test_tables_align_numbers_right_and_text_left(capsys: pytest.CaptureFixture[str]) -> None:
    print_aligned(("mode", "n", "what"), [["agent", "1", "tune 0"], ["unmanaged", "10", "-"]],
                  text_last=True)
    assert capsys.readouterr().out.splitlines() == [
        "mode        n    what",
        "agent       1  tune 0",
        "unmanaged  10  -     "]


def test_the_actions_say_the_eviction_managers_own_choices() -> None:
    text = actions_text(Counter({"eviction_chosen": 3, "tune engage done": 2}), 2)
    assert text.startswith("tune 1+0 rel,")
    assert text.endswith("evict (dry-run) 0+0, eviction choices 1.5")


class Pid:
    def __init__(self, pid: int | None) -> None:
        self.pid = pid


def test_each_process_of_the_node_counts_for_its_party() -> None:
    watched = [("online", Pid(11)), ("online service", Pid(12)), ("offline etl-0", Pid(13)),
               ("offline etl-1", Pid(14))]
    assert party_pids(watched, Pid(15), Pid(16)) == {
        "probe": [11], "service": [12], "load": [15], "offline": [13, 14], "agent": [16]}
    # no load generator, no agent (a mode without one), an agent not started: nothing of them
    assert party_pids(watched[:1], None, Pid(None)) == {
        "probe": [11], "service": [], "load": [], "offline": [], "agent": []}
    assert party_pids([], None, None)["agent"] == []


def test_a_partys_times_sum_its_processes_and_a_gone_one_is_unknown() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", THREAD_SPINS], stdout=subprocess.PIPE,
                               text=True)
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        for child in (spinner, sleeper):
            assert child.stdout is not None
            assert child.stdout.readline() == "ready\n"
        time.sleep(0.5)
        asleep = party_times({"offline": [sleeper.pid]})["offline_run_ns"]
        before = party_times({"offline": [spinner.pid]})["offline_run_ns"]
        both = party_times({"offline": [spinner.pid, sleeper.pid], "agent": []})
        after = party_times({"offline": [spinner.pid]})["offline_run_ns"]
    finally:
        for child in (spinner, sleeper):
            child.kill()
            child.wait()
            assert child.stdout is not None
            child.stdout.close()
    run = both["offline_run_ns"]
    assert asleep is not None
    assert before is not None
    assert after is not None
    assert run is not None
    assert before >= 200_000_000  # the spinning thread's, not its sleeping main thread's
    # the sum of the spinner's (read between two readings of it) and the sleeper's (still)
    assert before + asleep <= run <= after + asleep
    assert both["offline_wait_ns"] is not None
    assert both["agent_run_ns"] == 0  # a party without a process: nothing of it ran
    assert both["agent_wait_ns"] == 0
    assert party_times({"offline": [spinner.pid, sleeper.pid]}) == {
        "offline_run_ns": None, "offline_wait_ns": None}  # gone


def test_the_budget_table_says_where_the_cpus_went(capsys: pytest.CaptureFixture[str]) -> None:
    first, second, old = rep("agent"), rep("agent", 2), rep("unmanaged")
    parties = ("probe", "service", "load", "offline", "agent")
    first.indicators = {f"{p}_{k}_ms_s": v for p in parties
                        for k, v in (("run", 100.0), ("wait", 10.0))}
    second.indicators = {**first.indicators, "offline_run_ms_s": 300.0,
                         "agent_wait_ms_s": None}
    rows = budget_rows([first, second, old])
    assert rows[0] == ["agent", "1", "100/10", "100/10", "100/10", "100/10", "100/10", "500"]
    assert rows[2] == ["agent", "all", "100/10", "100/10", "100/10", "200/10", "100/10", "600"]
    # a run from before these readings: every cell unknown, the sum too
    assert rows[4] == ["unmanaged", "all", "-/-", "-/-", "-/-", "-/-", "-/-", "-"]
    print_budget_table([first], "2")
    out = capsys.readouterr().out.splitlines()
    assert "the machine has 2 CPU(s), 1000 ms/s each" in out[0]
    assert out[1].split() == ["mode", "rep", "probe", "service", "load", "offline", "agent",
                              "CPU", "sum"]
