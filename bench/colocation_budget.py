"""Where the node's CPUs went over a window: the colocation benchmark's fourth table.

An online pod beside an offline job can lose no page and still answer later: it waits for a
CPU. Per party, the table gives its time on a CPU and its time runnable but waiting for one, in
ms per second of the window (from ``/proc/PID/task/*/schedstat``, summed over the threads of
the party's processes, read at the window's ends): the online pod's probe and key-value service,
the load generator (on a real node, clients on other machines; here it runs on the node
measured), the offline pods and the agent. The sum of their CPU against the machine's CPUs
(1,000 ms/s each) says how busy the node was; what it leaves is the benchmark's own process (the
cost table), the kernel's threads and idle time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from bench.colocation_indicators import task_times_ns
from bench.colocation_plan import Repetition
from bench.colocation_report import fmt, groups, mean, print_aligned

PARTIES = ("probe", "service", "load", "offline", "agent")
WATCHED = {"online": "probe", "online service": "service"}
"""The party of each of the benchmark's watched workloads by its name; every other is an
offline pod's (``offline NAME``)."""


class Process(Protocol):
    @property
    def pid(self) -> int | None: ...


def party_pids(watched: Sequence[tuple[str, Process]], load: Process | None,
               agent: Process | None) -> dict[str, list[int]]:
    """The processes of each party: the watched workloads by name, the load generator's, the
    agent's main process (its threads; not the short-lived children it writes with)."""
    found: dict[str, list[int]] = {party: [] for party in PARTIES}
    for party, process in [*((WATCHED.get(name, "offline"), p) for name, p in watched),
                           ("load", load), ("agent", agent)]:
        if process is not None and process.pid is not None:
            found[party].append(process.pid)
    return found


def party_times(parties: Mapping[str, Sequence[int]]) -> dict[str, int | None]:
    """``PARTY_run_ns`` and ``PARTY_wait_ns`` for each party: summed over its processes, 0 for
    a party without one (nothing of it ran), None where a process could not be read (gone)."""
    found: dict[str, int | None] = {}
    for party, pids in parties.items():
        run: int | None = 0
        wait: int | None = 0
        for pid in pids:
            one_run, one_wait = task_times_ns(pid)
            run = None if run is None or one_run is None else run + one_run
            wait = None if wait is None or one_wait is None else wait + one_wait
        found[f"{party}_run_ns"], found[f"{party}_wait_ns"] = run, wait
    return found


BUDGET_COLUMNS = ("mode", "rep", *PARTIES, "CPU sum")


def budget_rows(reps: Sequence[Repetition]) -> list[list[str]]:
    """Per repetition and per mode (the mean), each party's ``run/wait`` ms/s and the sum of
    their CPU ms/s; ``-`` for a reading a repetition does not have."""
    rows = []
    for mode, label, group in groups(reps):
        def avg(key: str, group: list[Repetition] = group) -> float | None:
            return mean([g.indicators.get(key) for g in group])

        runs = [avg(f"{party}_run_ms_s") for party in PARTIES]
        known = [run for run in runs if run is not None]
        rows.append([mode, label,
                     *(f"{fmt(run, 0)}/{fmt(avg(f'{party}_wait_ms_s'), 0)}"
                       for party, run in zip(PARTIES, runs, strict=True)),
                     fmt(sum(known) if len(known) == len(runs) else None, 0)])
    return rows


def print_budget_table(reps: Sequence[Repetition], cpus: str) -> None:
    print(f"where the CPUs went: each party's ms a second of the window on a CPU / runnable "
          f"waiting for one (mean per repetition); the machine has {cpus} CPU(s), 1000 ms/s "
          f"each; the load generator stands for clients on other machines")
    print_aligned(BUDGET_COLUMNS, budget_rows(reps))
