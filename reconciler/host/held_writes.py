"""What observe mode said of each file it held a write to, so each held write is audited once:
a loop decides the same write again every cycle while the file stays as it is."""

from __future__ import annotations

import threading

MOST_FILES = 4096
"""Files remembered at most (a node's containers' files fit); past it the file held longest ago
is forgotten: one of a container gone since, not one whose write every cycle holds again."""


class HeldWrites:
    """The value last audited per file; safe from the loops' threads, which share a view."""

    def __init__(self) -> None:
        self._said: dict[str, str] = {}  # in the order last held: the oldest first
        self._lock = threading.Lock()

    def news(self, path: str, value: str) -> bool:
        """Whether holding ``value`` for ``path`` is to be audited (not the value last said)."""
        with self._lock:
            said = self._said.pop(path, None)
            if said != value and len(self._said) >= MOST_FILES:
                del self._said[next(iter(self._said))]
            self._said[path] = value
        return said != value
