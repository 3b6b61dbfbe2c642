"""The benchmark's removal of a cgroup its tasks have just left: retried until gone or out of
time. A non-empty directory stands for the busy cgroup (rmdir fails the same way)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from bench.kubelet_node import remove_cgroup


def test_a_cgroup_that_is_gone_or_free_is_removed_at_once(tmp_path: Path) -> None:
    free = tmp_path / "free"
    free.mkdir()
    assert remove_cgroup(free, within_s=0.0)
    assert not free.exists()
    assert remove_cgroup(tmp_path / "never", within_s=0.0)


def test_a_busy_cgroup_is_tried_until_its_time_is_up(tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    (busy / "task").mkdir(parents=True)
    started = time.monotonic()
    assert not remove_cgroup(busy, within_s=0.2)
    assert time.monotonic() - started >= 0.2
    assert busy.is_dir()
    assert not remove_cgroup(busy, within_s=0.0)  # one attempt, no wait


def test_a_cgroup_freed_while_waited_for_is_removed(tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    (busy / "task").mkdir(parents=True)
    freeing = threading.Timer(0.1, (busy / "task").rmdir)
    freeing.start()
    try:
        assert remove_cgroup(busy, within_s=30.0)
    finally:
        freeing.join()
    assert not busy.exists()
