"""What was said of each file whose write was held back (observe mode) or refused by the kernel,
or that could not be read, so each is said once: a loop decides the same write again every cycle
while the file stays as it is, and the kernel refuses it again for the same reason."""

from __future__ import annotations

import threading

import structlog

log = structlog.get_logger("nri_qos.sysfs")

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

    def forget(self, path: str) -> bool:
        """Forget what was said of ``path``; whether anything was."""
        if path not in self._said:  # the common case, without taking the lock
            return False
        with self._lock:
            return self._said.pop(path, None) is not None


class Refusals(HeldWrites):
    """The refusal (errno and message) last said per file: a write the kernel refuses at every
    cycle is said (``write_failed``, ``cgroup_write_failed``) when its refusals start or change
    errno and only counted meanwhile; a write to the file taken again, or the file found holding
    the value wanted, ends them (``write_refusals_ended``), and the next refusal is said again."""

    def ended(self, path: str) -> None:
        if self.forget(path):
            log.info("write_refusals_ended", path=path)
