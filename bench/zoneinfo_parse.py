"""Parsing ``/proc/zoneinfo``, as detection (every second) and the memory guard and NUMA loops
do: microseconds per parse by the number of CPUs, whose pagesets make up most of the file; the
agent's parser against a plain line-by-line loop over the same text (prints numbers; not a test).

usage: python bench/zoneinfo_parse.py
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from reconciler.host.numa import ZONE_HEADER, node_lows, parse_zoneinfo
from reconciler.host.values import PAGE_SIZE

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/kernel/numa2_zoneinfo"
CPU_ENTRY = re.compile(r"    cpu: \d+\n(?:              .*\n){5}  vm stats threshold: \d+\n")
CPUS = (2, 16, 96, 192)


def zoneinfo_for(cpus: int) -> str:
    """The two-node fixture with every zone's pageset list as long as ``cpus`` CPUs make it."""
    text = FIXTURE.read_text()
    entry = CPU_ENTRY.search(text)
    assert entry is not None, "the fixture has no pageset entry"
    template = re.sub(r"cpu: \d+", "cpu: {}", entry.group(0))
    pagesets = "".join(template.format(cpu) for cpu in range(cpus))
    # each zone's run of entries becomes the new list
    return re.sub(f"(?:{CPU_ENTRY.pattern})+", lambda _: pagesets, text)


def line_by_line(text: str) -> dict[int, int]:
    """The low watermarks per node by a Python loop over every line (the reference)."""
    lows: dict[int, int] = {}
    node: int | None = None
    for line in text.splitlines():
        header = ZONE_HEADER.match(line)
        if header:
            node = int(header.group(1))
            lows.setdefault(node, 0)
            continue
        words = line.split()
        if node is not None and len(words) == 2 and words[0] == "low":
            lows[node] += int(words[1]) * PAGE_SIZE
    return lows


def per_call_us(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget_s:
        fn()
        calls += 1
    return elapsed / calls * 1e6


def main() -> None:
    print(f"{'cpus':>5} {'lines':>6} {'KiB':>5} {'line loop us':>13} {'zones us':>9}")
    for cpus in CPUS:
        text = zoneinfo_for(cpus)
        assert node_lows(parse_zoneinfo(text), PAGE_SIZE) == line_by_line(text)
        print(f"{cpus:>5} {text.count(chr(10)):>6} {len(text) // 1024:>5} "
              f"{per_call_us(partial(line_by_line, text)):>13.1f} "
              f"{per_call_us(partial(parse_zoneinfo, text)):>9.1f}")
    print("zones us: reconciler.host.numa.parse_zoneinfo (system_free and numa_free each "
          "cycle, the memory guard, the NUMA loops)")


if __name__ == "__main__":
    main()
