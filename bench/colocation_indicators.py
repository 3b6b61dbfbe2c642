"""The kernel's counters the colocation benchmark reads before and after each window: what the
online container suffered, what the offline tier and the machine paid."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from bench.kubelet_node import Container, KubeletNode
from reconciler.host.parse import parse_counters, parse_psi

OFFLINE_TIER = "kubepods/besteffort"
"""Where kubelet puts the offline (BestEffort) pods."""


def system_stall_us(resource: str) -> int | None:
    """The machine's cumulative 'some' stall (µs), from /proc/pressure."""
    try:
        text = Path(f"/proc/pressure/{resource}").read_text()
    except OSError:
        return None
    return parse_psi(text).some_total_us


def vmstat(key: str) -> int | None:
    """A machine-wide counter of /proc/vmstat."""
    try:
        text = Path("/proc/vmstat").read_text()
    except OSError:
        return None
    return parse_counters(text).get(key)


def task_times_ns(pid: int | None) -> tuple[int | None, int | None]:
    """A process's time on a CPU and its time runnable but waiting for one (ns, summed over its
    threads, from ``/proc/PID/task/*/schedstat``); None for each without the process or the
    kernel's scheduler statistics."""
    if pid is None:
        return None, None
    run = wait = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            fields = (task / "schedstat").read_text().split()
            run, wait = run + int(fields[0]), wait + int(fields[1])
    except (OSError, IndexError, ValueError):
        return None, None
    return run, wait


def snapshot(node: KubeletNode, online: Container,
             times: Mapping[str, int | None]) -> dict[str, int | None]:
    """The kernel's counters that tell whether the online container was reclaimed from, and
    what the offline tier and the machine paid: the tier's refaults (its data set read again
    from disk after reclaim) and stalls, and kswapd's scanning (the machine's own reclaim).
    And ``times`` (:func:`bench.colocation_budget.party_times`), each party's time on a CPU
    and waiting for one: the service's same requests taking more CPU time beside the offline
    job means a slower CPU, more waiting a lost turn at it."""
    prefix = "" if node.v2 else "total_"
    stat = node.stat(online.rel)
    tier = node.stat(OFFLINE_TIER)
    return {
        "majfault": stat.get(f"{prefix}pgmajfault"),
        "refault": stat.get(f"{prefix}workingset_refault_file"),
        "pgscan": stat.get("pgscan") if node.v2 else None,  # v1 memory.stat has none
        "kubepods_hits": node.limit_hits("kubepods"),
        "offline_tier_hits": node.limit_hits(OFFLINE_TIER),
        "offline_tier_throttled": node.throttle_hits(OFFLINE_TIER),
        "psi_memory_us": node.stall_us(online.rel, "memory"),
        "psi_io_us": node.stall_us(online.rel, "io"),
        "psi_cpu_us": node.stall_us(online.rel, "cpu"),
        "offline_refault": tier.get(f"{prefix}workingset_refault_file"),
        "offline_majfault": tier.get(f"{prefix}pgmajfault"),
        "offline_psi_memory_us": node.stall_us(OFFLINE_TIER, "memory"),
        "offline_psi_io_us": node.stall_us(OFFLINE_TIER, "io"),
        "kswapd_scan": vmstat("pgscan_kswapd"),
        "system_psi_memory_us": system_stall_us("memory"),
        **times,
    }


def indicator_deltas(before: dict[str, int | None], after: dict[str, int | None],
                     seconds: float) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, start in before.items():
        end = after[key]
        delta = None if start is None or end is None else end - start
        if key.endswith("_us"):  # a stall share: ms of stall per second
            out[key.replace("_us", "_ms_s")] = None if delta is None else delta / 1000 / seconds
        else:
            out[key] = delta
        if key.endswith("_ns"):  # a time on (or waiting for) a CPU: ms per second too
            out[key.replace("_ns", "_ms_s")] = None if delta is None else delta / 1e6 / seconds
    return out
