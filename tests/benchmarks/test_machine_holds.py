"""``bench/machine_holds.py``: a real-time sampler's lateness per phase of memory, CPU and
disk work on this machine."""

from __future__ import annotations

import argparse

import pytest

import bench.machine_holds as holds
from bench.machine_holds import Phase, main, rows


def test_a_wake_up_counts_in_the_phase_it_falls_in_both_ends_included() -> None:
    lateness = [(1.0, 0.001), (2.0, 0.003), (2.5, 0.100), (3.0, 0.002), (9.0, 0.500)]
    found = rows(lateness, [Phase("a", 1.0, 2.0), Phase("b", 2.5, 3.0), Phase("c", 4.0, 5.0)],
                 held_ms=50.0)
    assert [(r.phase, r.samples) for r in found] == [("a", 2), ("b", 2)]  # c: no wake-up
    a, b = found
    assert a.seconds == 1.0
    assert a.median_ms == pytest.approx(2.0)
    assert b.max_ms == pytest.approx(100.0)


def test_a_wake_up_exactly_held_ms_late_counts_as_held_and_one_just_under_does_not() -> None:
    lateness = [(1.0, 0.050), (1.5, 0.0499999)]
    (row,) = rows(lateness, [Phase("a", 0.0, 2.0)], held_ms=50.0)
    assert row.held == 1


def test_a_short_run_reports_its_phases(capsys: pytest.CaptureFixture[str]) -> None:
    # 64 MiB: faulted in over several of the sampler's 10 ms periods (16 MiB took less than
    # one on a fast machine, and a phase without a wake-up is left out of the table)
    assert main(["--mib", "64", "--rounds", "1", "--seconds", "0.3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] in ("sampler at fifo priority; lateness of its wake-ups in ms",
                        "sampler at normal priority; lateness of its wake-ups in ms")
    phases = [line.split()[0] for line in lines[2:-1]]
    assert phases[:3] == ["idle", "cpu", "touch"]
    idle = lines[2].split()
    assert float(idle[1]) >= 0.3
    assert int(idle[2]) >= 20  # 0.3 s at one wake-up per 10 ms
    assert lines[-1].startswith("largest lateness of the run: ")


def test_a_sampler_that_fails_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holds, "SAMPLER", "import sys; sys.exit(3)")
    args = argparse.Namespace(period_ms=10.0, held_ms=50.0)
    with pytest.raises(RuntimeError, match="the sampler ended with status 3"):
        holds.measure(args, lambda run: None)


@pytest.mark.parametrize("option", ["--mib", "--rounds", "--seconds", "--period-ms"])
def test_a_size_or_time_of_zero_is_refused(option: str) -> None:
    with pytest.raises(SystemExit) as stopped:
        main([option, "0"])
    assert stopped.value.code == 2
