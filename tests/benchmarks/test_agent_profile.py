"""``bench/agent_profile.py``: every thread of a process profiled against its own CPU clock,
and the report that sums the profiles."""

from __future__ import annotations

import pstats
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.agent_env import agent_command
from bench.agent_profile import cumulative, load, main, report
from bench.colocation_cli import parser, settings_from
from tests.support.paths import REPO

RUNNER = REPO / "bench" / "agent_profile.py"
Run = tuple[Path, subprocess.CompletedProcess[str]]

# Laid out as the agent's packages are, so that the report counts its functions as the agent's.
PROGRAM = textwrap.dedent("""
    import queue, sys, threading, time

    def burn(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def blocked(waiting):
        waiting.get()

    threading.Thread(target=blocked, args=(queue.Queue(),), name="waiter", daemon=True).start()
    worker = threading.Thread(target=burn, args=(0.3,), name="pool_0")
    worker.start()
    worker.join()
    time.sleep(0.4)
    print("args", sys.argv[1:])
    sys.exit(3)
""")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("program")
    (root / "reconciler" / "burner").mkdir(parents=True)
    (root / "reconciler" / "__init__.py").write_text("")
    (root / "reconciler" / "burner" / "__main__.py").write_text(PROGRAM)
    out = root / "profile"
    done = subprocess.run([sys.executable, "-S", str(RUNNER), "profile", str(out),
                           "reconciler.burner", "a", "--b"],
                          cwd=root, capture_output=True, text=True, timeout=60)
    return out, done


def stats_of(out: Path, thread: str) -> pstats.Stats:
    (path,) = out.glob(f"*-{thread}.prof")
    return pstats.Stats(str(path))


def test_the_module_runs_as_python_m_would(
        profiled: Run) -> None:
    _, done = profiled
    assert done.returncode == 3, done.stderr
    assert done.stdout == "args ['a', '--b']\n"


def test_every_thread_has_a_profile(profiled: Run) -> None:
    out, _ = profiled
    assert sorted(p.name.split("-", 1)[1] for p in out.glob("*.prof")) == [
        "MainThread.prof", "pool_0.prof", "waiter.prof"]


def test_a_thread_is_charged_its_cpu_not_the_wall_clock(
        profiled: Run) -> None:
    out, _ = profiled
    assert cumulative(stats_of(out, "pool_0"), ("burner/__main__.py", "burn")) >= 0.3
    # 0.4 s asleep: on a wall clock, 0.4
    assert cumulative(stats_of(out, "MainThread"), ("~", "<built-in method time.sleep>")) < 0.1


def test_a_call_blocked_at_exit_weighs_what_its_own_thread_ran(
        profiled: Run) -> None:
    out, _ = profiled
    # Its queue's get was pending when the profiles were written, against the waiter's clock;
    # against the main thread's it would weigh all the main thread ran after it.
    assert stats_of(out, "waiter").total_tt < 0.1  # type: ignore[attr-defined]


def test_the_report_sums_threads_pools_and_the_agents_functions(
        profiled: Run) -> None:
    out, _ = profiled
    text = report(load([out]))
    lines = text.splitlines()
    pool = next(line for line in lines if line.endswith("  pool"))
    assert float(pool.split()[0]) >= 0.3
    assert "main thread: 0.00 s in its event loop" in text  # no event loop in this program
    burn = next(line for line in lines if line.endswith(" burn"))
    assert burn.split()[1].startswith("reconciler/burner/__main__.py:")
    assert float(burn.split()[0]) >= 0.3
    # the module's own code ran once, at its import: counted in the start, not listed
    assert not [line for line in lines if line.endswith("<module>")]


def test_a_directory_without_profiles_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert f"no profile (*.prof) under {tmp_path}" in capsys.readouterr().err


def test_the_agent_command_profiles_the_agent(tmp_path: Path) -> None:
    command, env = agent_command(REPO, tmp_path / "env", profile=tmp_path / "profile")
    done = subprocess.run([*command, "default-config"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# nri-qos node configuration")
    assert [p.name.split("-", 1)[1] for p in (tmp_path / "profile").glob("*.prof")] == [
        "MainThread.prof"]


def test_profiling_the_agent_needs_its_work_directories_kept() -> None:
    with pytest.raises(ValueError, match="give --keep too"):
        settings_from(parser("").parse_args(["--profile-agent"]), 23 * 1024, v2=True)
    settings, _ = settings_from(parser("").parse_args(["--profile-agent", "--keep", "/x"]),
                                23 * 1024, v2=True)
    assert settings.profile_agent
