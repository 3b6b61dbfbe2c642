"""A test's view of processes from /proc: which children a process has, whether one lives, and
the CPU time it used."""

from __future__ import annotations

import os
from pathlib import Path


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, the fields after it do not.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU time of process ``pid`` so far (with ``children``: its reaped children's
    too); OSError once it is gone."""
    # pid (comm) state ...: comm may hold spaces; utime, stime, cutime, cstime are fields 14-17
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15 if children else 13]) / os.sysconf("SC_CLK_TCK")
