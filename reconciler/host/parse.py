"""Parsers of the kernel's pressure and counter files; pure, and strict about what they accept.

Each raises :class:`ParseError` (a :class:`ValueError`) with a short reason when the text is not
what the kernel writes: a detector turns that into an ``unknown`` reading, never into "no
pressure"; offloading skips the container for that cycle.

* ``/proc/pressure/memory`` and cgroup v2 ``memory.pressure``::

      some avg10=0.00 avg60=0.01 avg300=0.25 total=7297477
      full avg10=0.00 avg60=0.00 avg300=0.16 total=5679473

  ``total`` is the cumulative stall time in microseconds; the averages are percentages.
* ``/proc/vmstat`` and ``memory.stat``: ``<name> <integer>`` per line.

``/proc/zoneinfo`` and the NUMA nodes' ``meminfo`` are parsed where the memory guard and the
NUMA loops parse them too (:mod:`reconciler.host.numa`), raising its ``NumaFormatError``.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass

from hooks.untrusted import bounded


def errno_text(exc: OSError) -> str:
    """Why the kernel refused a read or write, as records and logs spell it:
    ``EACCES: Permission denied``."""
    return f"{errno.errorcode.get(exc.errno or 0, str(exc.errno))}: {exc.strerror}"


class ParseError(ValueError):
    """Kernel file text that does not parse."""


def _quote(line: str) -> str:
    return repr(bounded(line, 60))


@dataclass(frozen=True, slots=True)
class Psi:
    """One pressure file's cumulative stall times (µs). The averages are not kept: a 10-second
    average cannot say what happened in the last 100 ms."""

    some_total_us: int
    # None where the file has no "full" line (kernels before 5.13 for cpu; memory always has it).
    full_total_us: int | None


def parse_psi(text: str) -> Psi:
    rows: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] not in ("some", "full"):
            raise ParseError(f"pressure line not understood: {_quote(line)}")
        fields = dict(w.partition("=")[::2] for w in words[1:])
        rows[words[0]] = fields
    if "some" not in rows:
        raise ParseError("no 'some' line" if text.strip() else "empty pressure file")

    def total(kind: str) -> int:
        raw = rows[kind].get("total")
        if raw is None or not raw.isdigit():
            raise ParseError(f"'{kind}' line has no total=<µs>")
        return int(raw)

    return Psi(total("some"), total("full") if "full" in rows else None)


def parse_counters(text: str) -> dict[str, int]:
    """``<name> <integer>`` lines (``/proc/vmstat``, ``memory.stat``)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if len(words) != 2:
            raise ParseError(f"counter line not understood: {_quote(line)}")
        try:
            values[words[0]] = int(words[1])
        except ValueError as exc:
            raise ParseError(f"counter line not understood: {_quote(line)}") from exc
    if not values:
        raise ParseError("empty counter file")
    return values


def parse_int(text: str) -> int:
    value = text.strip()
    try:
        return int(value)
    except ValueError as exc:
        raise ParseError(f"not an integer: {_quote(value)}") from exc


def require(values: dict[str, int], names: Sequence[str], what: str) -> list[int]:
    """The named counters, or a ParseError naming the first one missing."""
    missing = [n for n in names if n not in values]
    if missing:
        raise ParseError(f"{what} lacks {missing[0]}")
    return [values[n] for n in names]
