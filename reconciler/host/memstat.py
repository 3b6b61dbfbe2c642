"""A pod's anonymous memory, from its memory cgroup's ``memory.stat``.

Anonymous memory is what a pod cannot give back without dying or swapping: page cache is left
out on purpose (the kernel reclaims it, and the drop-cache action frees it), so a pod that only
reads files is not ranked as a memory hog. The pod cgroup's counters cover its containers:

* cgroup v1: ``total_rss`` (the hierarchical ``rss``; transparent huge pages are already part
  of it, ``rss_huge`` only says how much of it is huge), falling back to ``rss``;
* cgroup v2: ``anon`` (hierarchical by nature).

Working-set refaults (pages evicted and read again while still in use) come from the same file:
``workingset_refault_anon`` + ``workingset_refault_file`` (Linux 5.9 split the one
``workingset_refault`` of older kernels by LRU); cgroup v1 prefixes the hierarchical counters
with ``total_``.
"""

from __future__ import annotations

from collections.abc import Mapping

from reconciler.host.cgroups import CgroupLayout, CgroupPathError, pod_parent_rel
from reconciler.host.sysfs import SysFs

ANON_KEYS: Mapping[bool, tuple[str, ...]] = {True: ("anon",), False: ("total_rss", "rss")}
"""The ``memory.stat`` keys of anonymous memory, by cgroup v2 or not: the first one present
counts (see the module doc)."""


def refault_pages(values: Mapping[str, int], v2: bool) -> int | None:
    """Working-set refaults (pages) from parsed ``memory.stat`` counters; None when the kernel
    does not count them."""
    prefix = "" if v2 else "total_"
    split = (f"{prefix}workingset_refault_anon", f"{prefix}workingset_refault_file")
    if split[1] in values:
        return values.get(split[0], 0) + values[split[1]]
    return values.get(f"{prefix}workingset_refault")


def anon_bytes(stat: str, v2: bool) -> int | None:
    """Anonymous bytes from the text of a ``memory.stat``; None when the key is absent or odd."""
    wanted = ANON_KEYS[v2]
    found: dict[str, str] = {}
    for line in stat.splitlines():
        key, _, value = line.partition(" ")
        if key in wanted:
            found[key] = value.strip()
    for key in wanted:
        if key in found:
            try:
                number = int(found[key])
            except ValueError:
                return None
            return number if number >= 0 else None
    return None


def pod_anon_bytes(sysfs: SysFs, layout: CgroupLayout, cgroup_parent: str) -> int | None:
    """The pod's anonymous memory; None when its cgroup parent is unusable or the file is gone
    or does not parse."""
    try:
        rel = pod_parent_rel(cgroup_parent)
    except CgroupPathError:
        return None
    text = sysfs.read(f"{layout.dir('memory', rel)}/memory.stat")
    return None if text is None else anon_bytes(text, layout.v2)
