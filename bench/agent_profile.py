"""Where the agent's CPU goes: every thread of a process profiled against its own CPU clock.

``bench/colocation.py --profile-agent`` runs each repetition's agent as

    python -S bench/agent_profile.py profile OUT nri_plugin run --config ...

which runs the module as ``python -m`` would, with a ``cProfile`` profiler in every thread
(the main one and each the process starts). Each profiler's clock is its own thread's CPU clock
(``pthread_getcpuclockid``), not the wall clock: under a busy machine a wall clock charges a
function for the time its thread waited for a CPU or for the interpreter's lock, and the
profile would show where the agent waited, not where it worked. At exit every thread's
profile is written to ``OUT/<pid>-<thread>.prof`` (``pstats`` files), a thread still running
then included: its pending calls are closed against its own clock, so a call blocked at exit
(a queue's ``get``) weighs what it ran, nothing.

Deterministic profiling costs a call a few clock reads: the agent runs two to three times
slower under it, and code of many small calls weighs more than it does unprofiled. Compare
its parts, not its total with an unprofiled run. Then

    python bench/agent_profile.py report DIR [DIR ...]

prints each thread's CPU seconds (executor threads summed per pool), how much of the main
thread was its event loop (the rest: start and stop, imports most of it), and the project's
functions (not its modules' import-time code) by the CPU they and their callees took, all
threads together.

Only the standard library: the profiled interpreter runs with ``python -S``.
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import os
import pstats
import re
import runpy
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PROJECT = re.compile(r"[/\\](?:nri_plugin|reconciler|hooks|common|protos)[/\\]")
"""A frame of the agent's own code (the packages the image installs), by its file's path."""

EVENT_LOOP = ("asyncio/base_events.py", "run_forever")


def thread_clock(ident: int) -> Callable[[], float]:
    """The CPU seconds thread ``ident`` has run, readable from any thread."""
    clock = time.pthread_getcpuclockid(ident)
    return lambda: time.clock_gettime(clock)


def file_name(pid: int, thread: str) -> str:
    return f"{pid}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', thread).strip('_')}.prof"


class Profiles:
    """A profiler per thread, each on its thread's CPU clock; ``dump`` writes them all."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._lock = threading.Lock()
        self._profiles: list[tuple[str, cProfile.Profile]] = []

    def start(self, name: str) -> cProfile.Profile:
        """A profiler for the calling thread, enabled."""
        profile = cProfile.Profile(thread_clock(threading.get_ident()))
        with self._lock:
            self._profiles.append((name, profile))
        profile.enable()
        return profile

    def patch_threads(self) -> None:
        """Every thread started from now on runs under a profiler of its own."""
        run = threading.Thread.run
        profiles = self

        def profiled_run(thread: threading.Thread) -> None:
            profile = profiles.start(thread.name)
            try:
                run(thread)
            finally:
                profile.disable()

        threading.Thread.run = profiled_run  # type: ignore[method-assign,assignment]

    def dump(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with self._lock:
            profiles = list(self._profiles)
        for name, profile in profiles:
            profile.dump_stats(self.out / file_name(os.getpid(), name))


def profile_module(out: Path, module: str, args: Sequence[str]) -> None:
    """Run ``module`` as ``python -m module args`` would, every thread profiled into ``out``."""
    # As -m would: the working directory first on the path (the agent runs from its tree).
    sys.path[0] = os.getcwd()
    sys.argv = [module, *args]
    profiles = Profiles(out)
    profiles.patch_threads()
    # At exit, after the interpreter joined the threads it waits for: their profiles are
    # complete by then, and a daemon thread still running is closed against its own clock.
    atexit.register(profiles.dump)
    main = profiles.start("MainThread")
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        main.disable()


def load(directories: Sequence[Path]) -> list[tuple[str, pstats.Stats]]:
    """Every profile under ``directories``: the thread it is of (a pool's threads under the
    pool's name) and its statistics."""
    found = []
    for directory in directories:
        for path in sorted(directory.rglob("*.prof")):
            thread = re.sub(r"^\d+-", "", path.stem)
            found.append((re.sub(r"_\d+$", "", thread), pstats.Stats(str(path))))
    if not found:
        raise ValueError(f"no profile (*.prof) under {', '.join(map(str, directories))}")
    return found


def _raw(stats: pstats.Stats) -> dict[tuple[str, int, str], tuple[Any, ...]]:
    return stats.stats  # type: ignore[attr-defined,no-any-return]


def cumulative(stats: pstats.Stats, where: tuple[str, str]) -> float:
    """CPU seconds of the function named ``where[1]`` in a file ending in ``where[0]``."""
    return sum(float(entry[3]) for (path, _, name), entry in _raw(stats).items()
               if name == where[1] and path.replace("\\", "/").endswith(where[0]))


def report(profiles: Sequence[tuple[str, pstats.Stats]], top: int = 25) -> str:
    threads: Counter[str] = Counter()
    loop = 0.0
    functions: Counter[str] = Counter()
    for thread, stats in profiles:
        threads[thread] += stats.total_tt  # type: ignore[attr-defined]
        if thread == "MainThread":
            loop += cumulative(stats, EVENT_LOOP)
        for (path, line, name), entry in _raw(stats).items():
            # A module's own code runs once, when it is imported: the start, summed above.
            found = PROJECT.search(path)
            if found is not None and name != "<module>":
                functions[f"{path[found.start() + 1:]}:{line} {name}"] += entry[3]
    total = sum(threads.values())
    lines = [f"CPU s, all threads: {total:.2f} in {len(profiles)} profile(s)", "", "by thread:"]
    lines += [f"  {seconds:8.2f}  {thread}" for thread, seconds in threads.most_common()]
    if threads["MainThread"]:
        lines.append(f"main thread: {loop:.2f} s in its event loop, "
                     f"{threads['MainThread'] - loop:.2f} s starting and stopping")
    lines += ["", f"the agent's functions with their callees (top {top}):"]
    lines += [f"  {seconds:8.2f}  {where}" for where, seconds in functions.most_common(top)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("profile", help="run a module with every thread profiled")
    run.add_argument("out", type=Path, help="where the profiles are written")
    run.add_argument("module")
    run.add_argument("args", nargs=argparse.REMAINDER)
    show = commands.add_parser("report", help="sum the profiles under directories")
    show.add_argument("directories", type=Path, nargs="+")
    show.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if args.command == "profile":
        profile_module(args.out, args.module, args.args)
        return 0
    try:
        print(report(load(args.directories), args.top))
    except ValueError as exc:
        print(f"agent_profile: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
