"""resctrl monitoring: LLC occupancy and memory bandwidth (MBM) counters of this agent's groups.

Where the hardware monitors (``info/L3_MON``), the kernel gives every control group a
``mon_data`` directory with one ``mon_L3_<id>`` directory per L3 domain, holding
``llc_occupancy`` (bytes of L3 the group's tasks occupy now), ``mbm_total_bytes`` and
``mbm_local_bytes`` (bytes of memory traffic since the group's RMID was allocated; they only
grow). A counter the hardware cannot report reads ``Unavailable`` (or ``Error``): it is left
out, not reported as zero. Only this agent's groups are read (class groups and pod groups), so
the number of groups is bounded by the levels and the node's pods.
"""

from __future__ import annotations

from dataclasses import dataclass

from hooks.levels import LEVEL_NAMES
from hooks.resctrl_groups import parse_group_name
from reconciler.host.resctrlfs import ResctrlFs

DOMAIN_PREFIX = "mon_L3_"
FILES = ("llc_occupancy", "mbm_total_bytes", "mbm_local_bytes")


@dataclass(frozen=True, slots=True)
class ResctrlUsage:
    """One group's counters in one L3 domain; None: the kernel did not report it."""

    group: str
    kind: str  # "class" or "pod"
    domain: str  # the L3 cache id, as in the directory name ("00", "01" ...)
    llc_occupancy_bytes: int | None
    mbm_total_bytes: int | None
    mbm_local_bytes: int | None
    # The pod of a pod's group; None for a class group.
    pod_uid: str | None = None


def _counter(fs: ResctrlFs, path: str) -> int | None:
    """A counter's value; None when gone, not a number ("Unavailable", "Error") or negative."""
    try:
        value = fs.sysfs.read_int(path)
    except OSError:  # a counter the kernel fails to read costs that counter only
        return None
    return value if value is not None and value >= 0 else None


def read_usage(fs: ResctrlFs) -> list[ResctrlUsage]:
    """The counters of every group of ours; empty without monitoring."""
    if not fs.info.monitoring:
        return []
    sysfs = fs.sysfs
    found: list[ResctrlUsage] = []
    for group in fs.our_groups():
        ref = parse_group_name(fs.prefix, group, LEVEL_NAMES)
        if ref is None:
            continue
        mon_data = f"{fs.group_path(group)}/mon_data"
        for entry in sysfs.list_subdirs(mon_data):
            if not entry.startswith(DOMAIN_PREFIX):
                continue
            base = f"{mon_data}/{entry}"
            llc, total, local = (_counter(fs, f"{base}/{name}") for name in FILES)
            if llc is None and total is None and local is None:
                continue
            found.append(ResctrlUsage(group, ref.kind, entry[len(DOMAIN_PREFIX):], llc, total,
                                      local, ref.key if ref.kind == "pod" else None))
    return found
