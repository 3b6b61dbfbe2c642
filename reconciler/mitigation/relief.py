"""Whether the squeeze relieved the online pod whose pressure engaged it. Pure: file text in.

The tune rung's squeeze can take only the reclaimed tier's page cache (it stays a step above
the tier's anonymous memory). Where something else presses the online pod (the tier's
anonymous memory filling ``kubepods``), a squeeze can cost the offline work and give the pod
nothing. With ``mitigation.tune.judge_s`` set, the rung notes the pod of the reading that
engaged it, that reading's value and the pod's cumulative counter (its PSI stall on cgroup v2,
its working-set refaults on cgroup v1); ``judge_s`` later it computes the same quantity over the
squeeze from the counter and compares. The engaging reading is the one that crossed the
threshold, so it errs high: a squeeze is kept on a doubtful verdict. The comparison is with
before the squeeze, not with no squeeze: a stall that falls by itself counts as relief (why the
judgment is off by default: ``docs/detection.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hooks.units import quantity
from reconciler.detection.config import PSI, REFAULT
from reconciler.detection.detectors import read_refaults, read_stall
from reconciler.detection.signals import Level, Reading
from reconciler.host.parse import ParseError

JUDGED = (PSI, REFAULT)
"""The detectors whose readings name a pod and count what the pod itself feels."""


@dataclass(frozen=True, slots=True)
class Mark:
    """The squeeze's start, as the pod that engaged it saw it."""

    pod_uid: str
    # The reading's value and unit: a stall share in percent (PSI) or refaults in pages/s.
    before: float
    unit: str
    detector: str
    # PSI at level high grades the 'full' share, the others the 'some' share.
    full: bool
    # Microseconds stalled (PSI) or pages refaulted (refault) at ``at``.
    counter: int
    at: float

    @property
    def file(self) -> str:
        return pod_file(self.detector)


def pod_file(detector: str) -> str:
    """The pod cgroup's file a judged detector's counter comes from."""
    return "memory.pressure" if detector == PSI else "memory.stat"


def judged(reading: Reading | None) -> bool:
    """Whether a squeeze engaged on ``reading`` can be judged: a pod's own reading."""
    return reading is not None and reading.detector in JUDGED and reading.pod_uid is not None


def counter(text: str, detector: str, full: bool, v2: bool) -> int:
    """The pod's cumulative counter from its file's text, read as the detector reads it.
    Raises :class:`ParseError`."""
    if detector != PSI:
        return read_refaults(text, v2, 0.0).pages
    stall = read_stall(text, 0.0)
    if not full:
        return stall.some_us
    if stall.full_us is None:
        raise ParseError("memory.pressure has no 'full' line")
    return stall.full_us


def mark(reading: Reading, text: str, v2: bool, at: float) -> Mark:
    """The squeeze's start for a reading :func:`judged` accepts. Raises :class:`ParseError`."""
    assert reading.pod_uid is not None
    full = reading.detector == PSI and reading.level is Level.HIGH
    return Mark(reading.pod_uid, reading.value, reading.unit, reading.detector, full,
                counter(text, reading.detector, full, v2), at)


def during(start: Mark, text: str, v2: bool, now: float) -> float | None:
    """The quantity ``start.before`` measured, over the squeeze so far; None when no time
    passed or the counter went back (the pod's cgroup was made anew). Raises
    :class:`ParseError`."""
    elapsed = now - start.at
    value = counter(text, start.detector, start.full, v2)
    if elapsed <= 0 or value < start.counter:
        return None
    if start.detector == PSI:
        return (value - start.counter) * 100 / (elapsed * 1e6)
    return (value - start.counter) / elapsed


def relieved(before: float, squeezed: float, min_relief_percent: float) -> bool:
    """Whether the squeeze took the pod's reading down by at least ``min_relief_percent``."""
    return squeezed <= before * (1 - min_relief_percent / 100)


def verdict_text(start: Mark, squeezed: float, ok: bool, min_relief_percent: float,
                 elapsed: float) -> str:
    need = start.before * (1 - min_relief_percent / 100)
    what = f"{start.detector} of pod {start.pod_uid}"
    return (f"{what} {quantity(round(start.before, 2), start.unit)} when the squeeze began, "
            f"{quantity(round(squeezed, 2), start.unit)} over its {elapsed:.0f} s "
            f"({'at or below' if ok else 'above'} {quantity(round(need, 2), start.unit)}: "
            f"{min_relief_percent:g} % less)")
