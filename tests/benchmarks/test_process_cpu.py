"""The CPU time the benchmarks read from /proc/<pid>/stat, with and without reaped children."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support.processes import cpu_seconds


def test_a_process_s_cpu_time_grows_and_its_reaped_children_count_only_when_asked() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) >= before + 0.1
    alone = cpu_seconds(os.getpid(), children=True) - cpu_seconds(os.getpid())
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time() + 0.3\n"
                    "while time.process_time() < t: pass"], check=True)
    with_child = cpu_seconds(os.getpid(), children=True) - cpu_seconds(os.getpid())
    assert with_child >= alone + 0.2


def test_a_gone_process_is_an_os_error() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(FileNotFoundError):
        cpu_seconds(child.pid)
