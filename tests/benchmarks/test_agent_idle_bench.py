"""``bench/agent_idle.py`` runs a real agent in both configurations and reads its costs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from bench.agent_idle import switches
from tests.support.paths import REPO
from tests.support.realroot import unavailable_any


def test_switches_counts_every_thread_of_a_process() -> None:
    voluntary, involuntary = switches(os.getpid())
    assert voluntary > 0
    assert involuntary >= 0


def test_one_short_round_of_each_configuration() -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench/agent_idle.py"), "--rounds", "1",
                           "--settle", "0.5", "--window", "1"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-3].split() == ["config", "CPU", "%", "of", "one", "core", "wake-ups/s",
                                 "preempted/s", "threads", "anon", "MiB", "file", "MiB",
                                 "peak", "MiB", "cgroup", "MiB"]
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[-2:]}
    assert set(rows) == {"creation", "agent"}
    for cpu, wakeups, _, threads, anon, mapped, peak, cgroup in rows.values():
        assert cpu >= 0
        assert wakeups > 0  # its loops woke in the window
        assert threads >= 2
        # a Python process with its libraries: megabytes of each, the peak at least their sum
        assert anon > 1
        assert mapped > 1
        assert peak >= anon + mapped - 1
        # as root, its own memory cgroup holds at least its anonymous pages; else not measured
        assert cgroup >= anon - 1 if not unavailable_any() else math.isnan(cgroup)


def test_against_another_checkout_runs_both_in_the_same_rounds(tmp_path: Path) -> None:
    """``--against``: both configurations of both checkouts (here the same one twice)."""
    done = subprocess.run([sys.executable, str(REPO / "bench/agent_idle.py"), "--rounds", "1",
                           "--settle", "0.5", "--window", "1", "--against", str(REPO)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split()[0] for line in done.stdout.splitlines()[-4:]]
    assert sorted(rows) == ["agent@after", "agent@before", "creation@after",
                            "creation@before"]
