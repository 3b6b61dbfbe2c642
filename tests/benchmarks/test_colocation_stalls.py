"""The colocation benchmark's stall tracing (``bench/colocation_stalls.py`` and its sampler,
``bench/colocation_sampler.py``): which requests make a stall, and what the sampler, run as
the benchmark runs it on real processes of this machine, says they did over one."""

from __future__ import annotations

import array
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import colocation_sampler
from bench.colocation_sampler import KTHREADS, thread_entry
from bench.colocation_stalls import (
    HELD_MS,
    LATE_MS,
    Sample,
    Sampler,
    Stall,
    explain,
    read_samples,
    stall_spans,
)
from bench.colocation_workloads import MISS
from tests.support.processes import children_of

MS = 1_000_000


def records(path: Path, pairs: list[tuple[int, int]]) -> Path:
    path.write_bytes(array.array("q", [v for pair in pairs for v in pair]).tobytes())
    return path


def test_a_stall_starts_at_exactly_the_late_threshold(tmp_path: Path) -> None:
    late = int(LATE_MS * MS)
    out = records(tmp_path / "service.bin", [
        (10 * MS, late - 1),  # not late enough
        (2_000 * MS, late),  # exactly late: a stall
        (3_000 * MS, 5 * MS)])
    assert stall_spans(out, 0, 10_000 * MS, 1000.0) == [
        Stall(2_000 * MS, 2_000 * MS + late, late)]  # no send records: sent_late_ns None


def test_a_stall_says_how_late_the_load_generator_sent(tmp_path: Path) -> None:
    out = records(tmp_path / "service.bin", [(1_000 * MS, 400 * MS), (1_005 * MS, 395 * MS),
                                             (3_000 * MS, 2 * MS)])
    # the two late requests sent 390 and 385 ms after due: the client stalled, not the server
    records(tmp_path / "service.bin.sent", [(1_000 * MS, 390 * MS), (1_005 * MS, 385 * MS),
                                            (3_000 * MS, 900 * MS)])
    [stall] = stall_spans(out, 0, 10_000 * MS, 1000.0)
    assert stall == Stall(1_000 * MS, 1_400 * MS, 400 * MS, 390 * MS)
    [line] = explain([], [stall], 0)
    assert line == ("stall at 1.0 s for 400 ms, no answer for 400 ms at most, requests sent up "
                    "to 390 ms after due: no samples")


def test_a_service_that_falls_behind_is_told_from_one_that_stops(tmp_path: Path) -> None:
    # falling behind: one answer every 10 ms for requests due every 5 ms, each later than the
    # last (late from the 21st on); stopping: nothing for 500 ms, then every request due in it
    # answered at once
    behind = [(i * 5 * MS, 200 * MS + i * 5 * MS) for i in range(150)]
    stop = [(2_000 * MS + i * 5 * MS, 500 * MS - i * 5 * MS) for i in range(40)]
    out = records(tmp_path / "service.bin", behind + stop)
    first, second = stall_spans(out, 0, 10_000 * MS, 1000.0)
    assert first == Stall(100 * MS, 1_690 * MS, 100 * MS)
    assert second == Stall(2_000 * MS, 2_500 * MS, 500 * MS)


def test_stalls_overlapping_merge_and_a_miss_lasts_the_timeout(tmp_path: Path) -> None:
    out = records(tmp_path / "service.bin", [
        (1_000 * MS, 400 * MS),  # 1.0-1.4 s
        (1_200 * MS, 500 * MS),  # 1.2-1.7 s: the same stall
        (5_000 * MS, MISS),  # never answered: 5.0-6.0 s with a 1,000 ms timeout
        (9_000 * MS, 1_500 * MS),  # answered after the timeout: a miss too
        (20_000 * MS, 400 * MS)])  # due after the window
    # the first stall's answers at 1.4 and 1.7 s: silent 400 ms, then 300
    assert stall_spans(out, 0, 10_000 * MS, 1000.0) == [
        Stall(1_000 * MS, 1_700 * MS, 400 * MS), Stall(5_000 * MS, 6_000 * MS, 1_000 * MS),
        Stall(9_000 * MS, 10_000 * MS, 1_000 * MS)]
    # a request due before the window is no stall of it, but its answer breaks the silence
    assert stall_spans(out, 1_100 * MS, 10_000 * MS, 1000.0)[0] == Stall(
        1_200 * MS, 1_700 * MS, 300 * MS)
    assert stall_spans(tmp_path / "absent.bin", 0, 10_000 * MS, 1000.0) == []


def test_explain_says_what_each_process_did_over_a_stall() -> None:
    def sample(t_ms: int, run_ms: int, wait_ms: int, state: str, runnable: int = 3) -> Sample:
        return Sample(t_ms * MS, runnable, {
            ("service", 7): (state, "0" if state == "R" else "unix_stream_read_generic",
                             run_ms * MS, wait_ms * MS),
            ("agent", 9): ("S", "do_epoll_wait", 0, 0)})

    samples = [sample(900, 10, 0, "S"), sample(1000, 10, 0, "R"), sample(1100, 10, 100, "R"),
               sample(1800, 20, 790, "R", 5)]
    samples[2].stacks.append(("agent", "cgroup_mkdir;kernfs_iop_mkdir"))
    [line] = explain(samples, [Stall(1_000 * MS, 1_900 * MS, 600 * MS)], 0)
    assert line.startswith("stall at 1.0 s for 900 ms, no answer for 600 ms at most: 3 samples, "
                           "largest gap 700 ms")
    assert "runnable 3-5 (median 3)" in line
    # the base sample (900 ms, S) counts for the deltas, not for the states
    assert "service: R 3; ran 10 ms, waited for a CPU 790 ms" in line
    assert "agent: S:do_epoll_wait 3; ran 0 ms" in line
    assert "blocked 1x: agent cgroup_mkdir;kernfs_iop_mkdir" in line
    assert explain(samples[:1], [Stall(5_000 * MS, 6_000 * MS, 1_000 * MS)], 0) == [
        "stall at 5.0 s for 1000 ms, no answer for 1000 ms at most: no samples"]


def test_a_sampler_held_past_its_usual_interval_is_told_at_exactly_the_threshold() -> None:
    def explained(extra_ns: int) -> str:
        times = [i * 200 * MS for i in range(10)]
        times += [times[-1] + extra_ns + i * 200 * MS for i in range(9)]
        samples = [Sample(t, 2, {("service", 7): ("S", "0", 0, 0)}) for t in times]
        [line] = explain(samples, [Stall(times[9] + MS, times[10] + MS, 150 * MS)], 0)
        return line

    at = int(HELD_MS * MS) + 200 * MS  # the usual 200 ms, held HELD_MS past it
    assert f"largest gap {at // MS} ms (100 ms past the sampler's usual 200: the machine " \
           "held it)" in explained(at)
    assert "held it" not in explained(at - 1)
    assert "largest gap 300 ms |" in explained(at - 1)


def test_the_sampler_sees_a_stopped_process_and_a_busy_one(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        sampler = Sampler(tmp_path / "tasks.txt", {"sleeper": sleeper.pid}, every_s=0.05)
        try:
            sampler.add("busy", busy.pid)  # added while it samples, as the offline pods are
            time.sleep(0.3)
            os.kill(sleeper.pid, signal.SIGSTOP)
            start = time.monotonic_ns()
            time.sleep(0.6)
            end = time.monotonic_ns()
            os.kill(sleeper.pid, signal.SIGCONT)
            time.sleep(0.2)
            busy.kill()  # a watched process ends while it samples, as the workloads do
            busy.wait()
            time.sleep(0.3)
        finally:
            sampler.close()
    finally:
        for p in (sleeper, busy):
            p.kill()
            p.wait()
    samples = read_samples(tmp_path / "tasks.txt")
    names = {name for s in samples for name, _ in s.threads}
    assert {"sleeper", "busy", "kswapd0"} <= names  # and the kernel's reclaim thread
    assert not {n for n in names if not n.startswith(("sleeper", "busy", *KTHREADS))}
    during = [s for s in samples if start < s.t_ns < end]
    assert len(during) >= 5
    assert all(s.threads[("sleeper", sleeper.pid)][0] == "T" for s in during[1:])
    before = [s for s in samples if s.t_ns < start - 100 * MS]
    assert before[-1].threads[("sleeper", sleeper.pid)][:2] != ("R", "0")
    [line] = explain(samples, [Stall(start, end, end - start)], 0)
    assert "sleeper: T " in line
    ran = int(line.split("busy: ")[1].split("ran ")[1].split(" ms")[0])
    assert ran > 100  # the busy loop was on a CPU for much of the 600 ms
    # a thread that ended is no longer sampled: its CPU time never reads as falling to zero
    for key in {k for s in samples for k in s.threads}:
        times = [s.threads[key][2] for s in samples if key in s.threads]
        assert times == sorted(times), key
    assert ("busy", busy.pid) not in samples[-1].threads


def test_a_sampler_that_cannot_start_says_so_and_leaves_no_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(colocation_sampler, "__file__", str(tmp_path / "gone.py"))
    before = children_of(os.getpid())
    with pytest.raises(RuntimeError, match=r"did not start \(exit status 2;"):
        Sampler(tmp_path / "tasks.txt", {"self": os.getpid()})
    assert children_of(os.getpid()) == before
    assert "gone.py" in capfd.readouterr().err  # the interpreter's own reason
    assert not (tmp_path / "tasks.txt").exists()


def test_a_thread_gone_is_not_an_entry() -> None:
    assert thread_entry("gone", "/proc/999999999/task/999999999") is None
    entry, state = thread_entry("me", f"/proc/{os.getpid()}/task/{os.getpid()}") or ("", "")
    name, tid, seen, wchan, run, wait = entry.split("/")
    assert (name, int(tid), seen, state) == ("me", os.getpid(), "R", "R")  # it reads itself
    assert wchan == "0"
    assert int(run) > 0
    assert int(wait) >= 0
