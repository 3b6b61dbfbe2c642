"""A reconciler loop whose first cycle waits for the test before it writes (a write to a memory
limit stuck in reclaim); every step it takes lands in a shared ``events`` list."""

from __future__ import annotations

import threading

from reconciler.loops.base import Loop


class GatedLoop(Loop):
    def __init__(self, name: str, events: list[str], *, blocks: bool = True,
                 wait_s: float = 10.0) -> None:
        """``blocks``: the first cycle waits (at most ``wait_s``, a bound against hanging) for
        ``go_on`` and then writes; without it the cycle returns at once."""
        self.name = name
        self.events = events
        self.started = threading.Event()
        self.go_on = threading.Event()
        self.closed = threading.Event()
        self._blocks = blocks
        self._wait_s = wait_s

    def interval(self) -> float:
        return 3600.0

    def cycle(self, now: float) -> None:
        self.events.append(f"{self.name} cycle started")
        self.started.set()
        if self._blocks:
            assert self.go_on.wait(self._wait_s)
            self.events.append(f"{self.name} wrote")

    def close(self) -> None:
        self.events.append(f"{self.name} closed")
        self.closed.set()
