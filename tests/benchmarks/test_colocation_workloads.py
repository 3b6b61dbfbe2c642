"""The workloads of ``bench/colocation.py`` (``bench/colocation_workloads.py``), each run as
the benchmark runs it: the online probe and the offline job in a node's cgroups on this
machine's kernel (what they record, and the offline job's read-through before its window), the
key-value service under its open-loop load. No timing is checked here."""

from __future__ import annotations

import array
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.colocation import WORKLOADS
from bench.colocation_report import read_pairs, read_progress
from bench.colocation_workloads import MISS
from bench.kubelet_node import MIB, KubeletNode
from tests.support.colocation import kernel

ONLINE_UID = "0c010c01-0000-4000-8000-0000000000fc"
OFFLINE_UID = "0c010c01-0000-4000-8000-0000000000fd"


def file_pages_mib(node: KubeletNode, rel: str) -> float:
    """Page cache charged to ``rel`` (``memory.stat``'s ``file`` on v2, ``cache`` on v1) (MiB)."""
    return node.stat(rel)["file" if node.v2 else "cache"] / MIB


@kernel
def test_the_workloads_record_latency_and_progress(tmp_path: Path) -> None:
    files = tmp_path / "online"
    files.mkdir()
    for name in ("a", "b"):
        (files / name).write_bytes(b"\x01" * (1 * MIB))
    (tmp_path / "input").write_bytes(b"\x02" * (4 * MIB))
    node = KubeletNode("colocunit", 512 * MIB, 64 * MIB, 2)
    try:
        online = node.add_pod("burstable", ONLINE_UID, "d" * 64, memory_limit=None,
                              cpu_request_milli=100)
        offline = node.add_pod("besteffort", OFFLINE_UID, "e" * 64,
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
    samples = read_pairs(tmp_path / "online.bin")
    assert samples
    assert all(duration > 0 for _, duration in samples)
    progress = read_progress(tmp_path / "offline.txt", 0, 1 << 62)
    assert progress[0] == (0.0, 0.0)
    assert progress[-1][1] > 0
    assert (tmp_path / "output").stat().st_size <= 2 * MIB


@kernel
@pytest.mark.parametrize("warm", [False, True])
def test_a_warm_offline_job_fills_its_cache_before_it_starts(tmp_path: Path, warm: bool) -> None:
    # The job says ready once its loop starts; with --warm only after it read its data set
    # through, uncounted, so its cgroup holds the whole set's page cache at that point and the
    # job's own count starts from nothing. Many SHA-256 rounds per MiB keep the loop itself
    # from reading the set within the test's reads.
    with (tmp_path / "input").open("wb") as data:
        data.write(b"\x02" * (24 * MIB))
        os.fsync(data.fileno())  # clean, so that the job's own read is charged to its cgroup
    node = KubeletNode("colocunit", 512 * MIB, 64 * MIB, 2)
    try:
        offline = node.add_pod("besteffort", OFFLINE_UID, "e" * 64, memory_limit=None,
                               cpu_request_milli=0)
        off = node.spawn(offline.rel, [
            sys.executable, "-I", str(WORKLOADS), "offline", "--input", str(tmp_path / "input"),
            "--output", str(tmp_path / "output"), "--output-mib", "1", "--anon-mib", "0",
            "--work-rounds", "200", "--out", str(tmp_path / "offline.txt"),
            *(["--warm"] if warm else [])], oom_score_adj=1000)
        assert off.stdout is not None
        assert off.stdout.readline().strip() == "ready"
        cached = file_pages_mib(node, offline.rel)
        node.stop(off)
        assert off.returncode == 0
    finally:
        node.close()
    if warm:
        assert cached >= 24
    else:
        assert cached < 12
    first_read = int((tmp_path / "offline.txt").read_text().split()[1])
    assert first_read <= 2 * MIB  # the read-through is not the job's work




def test_the_service_answers_an_open_loop_load(tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "a").write_bytes(b"\x03" * MIB)
    sock, out = tmp_path / "kv.sock", tmp_path / "service.bin"
    server = subprocess.Popen([sys.executable, "-I", str(WORKLOADS), "serve", "--files",
                               str(files), "--anon-mib", "1", "--socket", str(sock)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        load = subprocess.Popen([sys.executable, "-I", str(WORKLOADS), "load", "--socket",
                                 str(sock), "--rps", "100", "--out", str(out), "--sent",
                                 str(tmp_path / "sent.bin")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert load.stdout is not None
        assert load.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        assert load.communicate("stop\n", timeout=30)[0].strip() == "done"
    finally:
        server.communicate("stop\n", timeout=30)
    records = array.array("q")
    records.frombytes(out.read_bytes())
    due = list(records[0::2])
    assert len(due) >= 2
    assert due == sorted(due)
    # one due time every 10 ms, whatever the answers did
    assert {b - a for a, b in itertools.pairwise(due)} <= {10_000_000}
    assert all(v == MISS or v > 0 for v in records[1::2])
    # every request sent at or after its due time, and recorded so
    sent = array.array("q")
    sent.frombytes((tmp_path / "sent.bin").read_bytes())
    assert list(sent[0::2]) == due
    assert all(0 <= late < 1_000_000_000 for late in sent[1::2])
