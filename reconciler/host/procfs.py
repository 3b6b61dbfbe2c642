"""The per-process files of /proc the loops use, through the sysfs layer."""

from __future__ import annotations

from reconciler.host.sysfs import Outcome, SysFs


def oom_score_adj_path(pid: int) -> str:
    return f"/proc/{pid}/oom_score_adj"


def set_oom_score_adj(sysfs: SysFs, pid: int, score: int, reason: str) -> Outcome:
    """Write ``/proc/<pid>/oom_score_adj`` unless it already holds ``score``."""
    return sysfs.write_if_changed(oom_score_adj_path(pid), str(score), reason)


def task_cgroups(sysfs: SysFs, tid: int) -> str | None:
    """The text of ``/proc/<tid>/cgroup``; None when the task is gone."""
    return sysfs.read(f"/proc/{tid}/cgroup")
