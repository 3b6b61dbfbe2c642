"""``bench/reconcile.py`` runs end to end on a small tree and measures every loop it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_every_loop_is_measured_on_a_small_tree(tmp_path: Path, version: str) -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench/reconcile.py"), "--sizes", "6",
                           "--cgroup", version, "--dir", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)["6"]
    for loop in ("resctrl_tasks", "drift", "memory_guard", "numa_binding"):
        assert report[loop]["changed_10pct"]["cpu_ms"] >= 0
    for loop in ("detection", "numa_balance", "eviction_facts"):
        assert set(report[loop]) == {"first", "idle"}
        assert report[loop]["idle"]["cpu_ms"] >= 0
    assert report["writes"] > 0
    assert report["tasks_moved"] > 0
    assert list(tmp_path.iterdir()) == []  # the tree is removed
