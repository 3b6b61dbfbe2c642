"""What one wake-up of the agent's event loop costs on this machine: CPU microseconds per wake of
a loop that only sleeps, by how it sleeps (prints numbers; not a test).

* ``asyncio.sleep``: the floor, a timer and nothing else;
* ``sleep_until, one event``: the agent's stop-aware sleep on the stop event alone, as almost
  every loop sleeps (the node's PSI polled every 100 ms under pressure among them);
* ``sleep_until, two events``: the same on two events (a stop and a wake), which needs a waiter
  task per event.

Each way sleeps ``--period`` at a time for ``--seconds``; the ways take turns for ``--rounds``
rounds, so that whatever else the machine does falls on all of them alike. CPU is the process's
(user and system), so what the kernel spends on each wake counts too.

usage: python bench/wakeups.py [--period 0.1] [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.aio import sleep_until


def ways(period: float) -> dict[str, Callable[[asyncio.Event, asyncio.Event], Awaitable[object]]]:
    return {
        "asyncio.sleep": lambda stop, wake: asyncio.sleep(period),
        "sleep_until, one event": lambda stop, wake: sleep_until(period, stop),
        "sleep_until, two events": lambda stop, wake: sleep_until(period, stop, wake),
    }


async def cost(sleep: Callable[[asyncio.Event, asyncio.Event], Awaitable[object]],
               seconds: float) -> float:
    """CPU microseconds per wake of a loop that sleeps with ``sleep`` for ``seconds``."""
    stop, wake = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    wakes = 0
    started = time.process_time()
    while loop.time() < end:
        await sleep(stop, wake)
        wakes += 1
    return (time.process_time() - started) / wakes * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--period", type=float, default=0.1, help="seconds per sleep")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each measure")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    found: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, sleep in ways(args.period).items():
            found.setdefault(name, []).append(asyncio.run(cost(sleep, args.seconds)))
    print(f"CPU per wake, sleeping {args.period:g} s at a time, {args.rounds} rounds of "
          f"{args.seconds:g} s (median, range):")
    for name, values in found.items():
        print(f"  {name:25s} {statistics.median(values):7.0f} us  "
              f"({min(values):.0f}-{max(values):.0f})")


if __name__ == "__main__":
    main()
