"""How kernel files spell values, and when two spellings are the same value: memory sizes
(``max``, ``-1`` and page-rounded limits), id lists (``0-2,5``) and plain text. Pure functions:
the comparators decide whether :meth:`~reconciler.host.sysfs.SysFs.write_if_changed` writes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

# Values cgroup v1 reports for "no limit" (PAGE_COUNTER_MAX rounded to pages), and anything above.
UNLIMITED_THRESHOLD = 1 << 62
# The kernel's page: the unit of /proc/zoneinfo, v1 memory.numa_stat and memcg limits.
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


Comparator = Callable[[str, str], bool]


def same_text(current: str, desired: str) -> bool:
    return current.strip() == desired.strip()


def parse_bytes(text: str) -> int | None:
    """A memory value as cgroup files show it; ``None`` means unlimited (``max``, ``-1``, huge)."""
    value = text.strip()
    if value in ("max", "-1", ""):
        return None
    number = int(value)
    return None if number >= UNLIMITED_THRESHOLD else number


def same_bytes(current: str, desired: str) -> bool:
    """Equal as the kernel stores them: limits are kept in whole pages, unlimited has many names."""
    try:
        have, want = parse_bytes(current), parse_bytes(desired)
    except ValueError:
        return same_text(current, desired)
    if have is None or want is None:
        return have is None and want is None
    return have // PAGE_SIZE == want // PAGE_SIZE


def parse_id_list(text: str) -> frozenset[int]:
    """A kernel list such as ``0-2,5`` (cpuset.mems); empty text is the empty set."""
    ids: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        ids.update(range(int(low), int(high or low) + 1))
    return frozenset(ids)


def format_id_list(ids: Iterable[int]) -> str:
    """The shortest kernel list form: ``{0, 1, 2, 5}`` -> ``0-2,5``."""
    ordered = sorted(set(ids))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def same_id_list(current: str, desired: str) -> bool:
    try:
        return parse_id_list(current) == parse_id_list(desired)
    except ValueError:
        return same_text(current, desired)
