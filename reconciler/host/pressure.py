"""The kernel's own pressure notifications, as descriptors an event loop can wait on.

* **PSI triggers** (``some <stall µs> <window µs>`` written to a pressure file): the open file
  signals ``POLLPRI`` when the stall within the window reaches the threshold. An event loop's
  reader waits for *readable*, which a pressure file never is, so the file is registered for
  ``EPOLLPRI`` in an epoll instance of its own and the epoll descriptor, which becomes readable
  when the trigger fires, is what the loop watches (handing the pressure file itself to
  ``add_reader`` wakes the loop continuously: measured 1.75 M empty wake-ups in 5 s).
* **cgroup v1 ``memory.pressure_level``**: one eventfd per level (``low``, ``medium``,
  ``critical``) registered through ``cgroup.event_control``; the kernel signals a level's
  eventfd for events at that level or above, right as reclaim happens (about 1 ms after a
  limit is hit, measured on a 2-core VM with kernel 6.18).

Both close with :meth:`close`; the kernel forgets the registration with the descriptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
from collections.abc import Callable, Mapping

from reconciler.host.sysfs import SysFs

PRESSURE_LEVELS = ("low", "medium", "critical")


class TriggerWatch:
    """An armed PSI trigger behind an epoll descriptor that is readable when it fired."""

    def __init__(self, sysfs: SysFs, path: str, stall_us: int, window_us: int) -> None:
        self.path = path
        self.window_us = window_us
        self._fd = sysfs.open_trigger(path, f"some {stall_us} {window_us}")
        self._epoll = select.epoll()
        try:
            self._epoll.register(self._fd, select.EPOLLPRI)
        except OSError:
            self.close()
            raise

    def fileno(self) -> int:
        """The descriptor to wait on for readability."""
        return self._epoll.fileno()

    def gone(self) -> bool:
        """Called when :meth:`fileno` was readable, which means the trigger fired: the event
        loop's own poll of this descriptor already consumed the kernel's one-shot POLLPRI (a
        nested poll reads it), so the readiness itself is the news. True when, instead, the
        pressure file went away (a cgroup removed under it: the trigger is dead), a condition
        that stays."""
        return any(mask & (select.EPOLLERR | select.EPOLLHUP)
                   for _fd, mask in self._epoll.poll(0))

    def close(self) -> None:
        self._epoll.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


class PressureLevelWatch:
    """``memory.pressure_level`` notifications of one v1 memcg, one eventfd per level."""

    def __init__(self, sysfs: SysFs, cgroup: str, mode: str) -> None:
        self.cgroup = cgroup
        self._sysfs = sysfs
        self._fds: dict[str, int] = {}
        try:
            for level in PRESSURE_LEVELS:
                self._fds[level] = sysfs.register_memcg_event(
                    cgroup, "memory.pressure_level", f"{level},{mode}")
        except OSError:
            self.close()
            raise

    @property
    def fds(self) -> Mapping[str, int]:
        """Level name -> eventfd (readable when the level's events arrived)."""
        return dict(self._fds)

    def consume(self, level: str) -> int:
        """Events counted at ``level`` (or above) since the last call."""
        try:
            return os.eventfd_read(self._fds[level])
        except BlockingIOError:
            return 0

    def alive(self) -> bool:
        """Whether the cgroup still exists (its removal signals every eventfd once)."""
        return self._sysfs.is_dir(self.cgroup)

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


async def while_readable(fds: Mapping[int, Callable[[], None]], stop: asyncio.Event) -> None:
    """Call each descriptor's callback (on the event loop) whenever it is readable, until
    ``stop``; the descriptors stay open (their owner closes them)."""
    loop = asyncio.get_running_loop()
    added: list[int] = []
    try:
        for fd, callback in fds.items():
            loop.add_reader(fd, callback)
            added.append(fd)
        await stop.wait()
    finally:
        for fd in added:
            loop.remove_reader(fd)
