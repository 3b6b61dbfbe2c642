"""The colocation benchmark's accounting of what the offline tier, the machine and the agent's
stand-ins paid (bench/colocation_report.py, bench/colocation_agent.py)."""

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
