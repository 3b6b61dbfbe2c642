"""The zones' low watermarks per NUMA node, read once and shared by every loop that compares free
memory with them (the free-memory detectors, the memory guard, NUMA binding and balance).

They change when an operator writes ``vm.min_free_kbytes`` or ``vm.watermark_scale_factor``,
when memory is hot-plugged (which may also change which nodes hold memory alone), and briefly
while the kernel boosts them after fragmentation, so a reading serves for ``MAX_AGE_S``.
``/proc/zoneinfo`` is the costliest file the agent reads every few seconds (each CPU's pagesets:
132 KiB on a 192-CPU server; 10 ms of CPU in a guest of two emulated CPUs), and the figures in it
that move every second, the free pages, come from meminfo instead.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from reconciler.host.numa import (
    WATERMARK_SCALE_FACTOR,
    ZONEINFO,
    NumaFormatError,
    memory_only,
    node_ids,
    node_lows,
    parse_zoneinfo,
)
from reconciler.host.sysfs import SysFs
from reconciler.host.values import PAGE_SIZE

MAX_AGE_S = 60.0
"""How long a reading serves before the files are read again (a reading that failed: until the
next caller's time differs from its own)."""


@dataclass(frozen=True, slots=True)
class Reading:
    """The watermarks as read at ``at``: the zones' low watermarks in bytes per NUMA node (None:
    ``problem`` says why; ``missing``: the kernel has no ``/proc/zoneinfo``),
    ``vm.watermark_scale_factor`` (None: missing), the NUMA nodes in sysfs and those of them
    with memory and no CPU (``far``: :func:`~reconciler.host.numa.memory_only`)."""

    at: float
    lows: Mapping[int, int] | None
    problem: str
    missing: bool
    watermark_scale_factor: str | None
    nodes: tuple[int, ...]
    far: frozenset[int] = frozenset()

    def node_lows(self) -> Mapping[int, int]:
        """The lows to compute a node's watermark with: none on a kernel without the file (the
        floor decides); :class:`NumaFormatError` when the file is there and not understood."""
        if self.lows is not None:
            return self.lows
        if self.missing:
            return {}
        raise NumaFormatError(self.problem)


class Watermarks:
    """One reading at a time for every caller (thread-safe: the loops run in worker threads);
    ``now`` is the caller's clock, the event loop's for every loop of the agent."""

    def __init__(self, sysfs: SysFs, max_age_s: float = MAX_AGE_S) -> None:
        self._sysfs = sysfs
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._reading: Reading | None = None

    def at(self, now: float) -> Reading:
        """The reading in force at ``now``: read again when ``max_age_s`` or more away from it
        (either way: a loop whose cycle began just before another loop's reading may ask with
        an earlier time), or failed at another time."""
        with self._lock:
            held = self._reading
            if held is None or (held.lows is None and held.at != now) or not (
                    abs(now - held.at) < self._max_age_s):
                held = self._reading = self._read(now)
            return held

    def _read(self, now: float) -> Reading:
        text = self._sysfs.read(ZONEINFO)
        lows: dict[int, int] | None = None
        problem = f"{ZONEINFO} is missing"
        if text is not None:
            try:
                lows, problem = node_lows(parse_zoneinfo(text), PAGE_SIZE), ""
            except NumaFormatError as exc:
                problem = str(exc)
        return Reading(now, lows, problem, text is None,
                       self._sysfs.read(WATERMARK_SCALE_FACTOR), tuple(node_ids(self._sysfs)),
                       memory_only(self._sysfs))
