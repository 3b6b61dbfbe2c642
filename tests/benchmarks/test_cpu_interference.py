"""``bench/cpu_interference.py``: how much a loop on one CPU slows while another CPU spins or
faults pages."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bench.cpu_interference as interference
from bench.cpu_interference import change_percent, disturbed, main, pick_cpus, render, row
from tests.support.processes import cpu_seconds

TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")


def test_percentiles_are_nearest_rank_and_the_median_is_the_middle() -> None:
    r = row("spin", [float(v) for v in range(10, 0, -1)])  # 1..10, unsorted
    assert (r.samples, r.median_ms, r.p10_ms, r.p90_ms) == (10, 5.5, 2.0, 10.0)
    assert row("idle", [3.0]).p90_ms == 3.0


def test_the_change_is_against_idle() -> None:
    assert change_percent(1200.0, 1800.0) == 50.0
    text = render([row("idle", [1200.0]), row("spin", [1800.0]), row("fault", [900.0])], 0, 1)
    lines = text.splitlines()
    assert lines[0] == "loop on CPU 0, CPU 1: ms per 1M Python steps"
    assert "(+0 %, n=1)" in lines[1]
    assert "(+50 %, n=1)" in lines[2]
    assert "(-25 %, n=1)" in lines[3]


def test_cpus_are_the_two_lowest_allowed_or_the_ones_named() -> None:
    assert pick_cpus({5, 2, 7}, None) == (2, 5)
    assert pick_cpus({0, 1, 2}, "2,0") == (2, 0)


@pytest.mark.parametrize(("allowed", "wanted", "message"), [
    ({0}, None, "two CPUs needed"),
    ({0, 1}, "0", "two CPU numbers"),
    ({0, 1}, "0,x", "two CPU numbers"),
    ({0, 1}, "1,1", "two different CPUs"),
    ({0, 1}, "0,3", "two different CPUs"),
])
def test_cpus_that_cannot_be_used_are_refused(allowed: set[int], wanted: str | None,
                                              message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pick_cpus(allowed, wanted)


@TWO_CPUS
@pytest.mark.parametrize("state", ["spin", "fault"])
def test_the_other_cpu_is_busy_on_that_cpu_alone_until_the_block_ends(state: str) -> None:
    cpu = max(os.sched_getaffinity(0))
    with disturbed(state, cpu, 16) as child:
        assert child is not None
        time.sleep(0.5)
        assert os.sched_getaffinity(child.pid) == {cpu}
        assert cpu_seconds(child.pid) >= 0.2
    assert child.poll() is not None


def test_idle_starts_nothing() -> None:
    with disturbed("idle", 0, 16) as child:
        assert child is None


def test_a_disturber_that_fails_to_start_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(interference.DISTURBERS, "spin", "import sys; sys.exit(4)")
    failed = pytest.raises(RuntimeError, match=r"spin process on CPU 0 did not start \(status 4")
    with failed, disturbed("spin", 0, 16):
        pass


@TWO_CPUS
def test_a_short_run_reports_every_state_and_gives_the_cpus_back(
        capsys: pytest.CaptureFixture[str]) -> None:
    allowed = os.sched_getaffinity(0)
    assert main(["--rounds", "1", "--samples", "2", "--steps", "20000", "--mib", "16",
                 "--settle-s", "0.1"]) == 0
    assert os.sched_getaffinity(0) == allowed
    lines = capsys.readouterr().out.splitlines()
    low = sorted(allowed)[:2]
    assert lines[0] == f"loop on CPU {low[0]}, CPU {low[1]}: ms per 1M Python steps"
    assert [line.split()[0] for line in lines[1:]] == ["idle", "spin", "fault"]
    assert all(line.endswith("n=2)") for line in lines[1:])


@pytest.mark.parametrize("option", ["--rounds", "--samples", "--steps", "--mib"])
def test_a_count_of_zero_is_refused(option: str) -> None:
    with pytest.raises(SystemExit) as stopped:
        main([option, "0"])
    assert stopped.value.code == 2


@TWO_CPUS
def test_the_script_runs_as_the_docs_call_it_from_any_directory(tmp_path: Path) -> None:
    script = Path(interference.__file__).resolve()
    done = subprocess.run([sys.executable, str(script), "--rounds", "1", "--samples", "1",
                           "--steps", "1000", "--mib", "1", "--settle-s", "0"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("loop on CPU ")
