"""The kernel's own pressure notifications, as descriptors an event loop can wait on.

* **PSI triggers** (``some <stall µs> <window µs>`` written to a pressure file): the open file
  signals ``POLLPRI`` when the stall within the window reaches the threshold. An event loop's
  reader waits for *readable*, which a pressure file never is, so the file is registered for
  ``EPOLLPRI`` in an epoll instance of its own and the epoll descriptor, which becomes readable
  when the trigger fires, is what the loop watches (handing the pressure file itself to
  ``add_reader`` wakes the loop continuously: measured 1.75 M empty wake-ups in 5 s).
* :class:`PsiWatch` reads a pressure file the way the kernel allows: waiting for a trigger and
  then reading it while pressure lasts, or polling it at a short interval (its cumulative
  ``total=`` counters; what the readings mean is the detectors' business).
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

import structlog

from common.aio import sleep_until
from reconciler.host.sysfs import SysFs

log = structlog.get_logger("nri_qos.pressure")

PRESSURE_LEVELS = ("low", "medium", "critical")
QUIET_TRIGGER_RECHECK_S = 10.0
"""How long a quiet, armed trigger waits before it looks whether it is still wanted: the kernel
wakes it when the stall comes, so nothing is learnt by waking the agent every ``idle()``
seconds; the look only notices a reload that switched the watch off."""


class TriggerWatch:
    """An armed PSI trigger behind an epoll descriptor that is readable when it fired."""

    def __init__(self, sysfs: SysFs, path: str, stall_us: int, window_us: int) -> None:
        self._fd = sysfs.open_trigger(path, f"some {stall_us} {window_us}")
        try:
            self._epoll = select.epoll()
        except OSError:  # at the descriptor limit: the next sync tries again
            os.close(self._fd)
            raise
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


class PsiWatch:
    """A pressure file, read after a trigger fired or every interval.

    ``trigger`` (``(stall_us, window_us)``): arm a trigger; while ``keep_reading()`` is false
    nothing is read, until the kernel wakes the watch (``on_trigger(at)``); from then on the file
    is read every ``interval()`` while ``keep_reading()`` holds. Without a trigger, or when the
    kernel refuses to arm it, the file is read every ``interval()`` (``mode`` says which); an
    armed trigger with nothing to read looks again after :data:`QUIET_TRIGGER_RECHECK_S` at
    the earliest. Each
    read goes to ``on_text(text, at)`` (text None: the file is gone). While ``active()`` is false
    the watch reads nothing, calls ``on_pause()`` and looks again after ``idle()`` seconds.
    Times are the event loop's.
    """

    def __init__(self, sysfs: SysFs, path: str, trigger: tuple[int, int] | None) -> None:
        self._sysfs = sysfs
        self.path = path
        self._trigger = trigger
        self.mode = "trigger" if trigger is not None else "poll"

    async def run(self, stop: asyncio.Event, *, interval: Callable[[], float],
                  idle: Callable[[], float], active: Callable[[], bool],
                  keep_reading: Callable[[], bool], on_trigger: Callable[[float], None],
                  on_text: Callable[[str | None, float], None],
                  on_pause: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        fired = asyncio.Event()
        watch = self._arm(loop, fired)
        try:
            while not stop.is_set():
                if not active():
                    on_pause()
                    await sleep_until(idle(), stop)
                    continue
                if self.mode == "trigger" and keep_reading():
                    fired.clear()  # fired again while under pressure: nothing new to learn
                elif self.mode == "trigger":
                    on_pause()  # quiet: nothing is read until the kernel wakes the watch
                    quiet_s = max(idle(), QUIET_TRIGGER_RECHECK_S)
                    if not await sleep_until(quiet_s, stop, fired) or stop.is_set() \
                            or self.mode != "trigger":  # the trigger died: poll from now on
                        continue
                    fired.clear()
                    on_trigger(loop.time())
                on_text(self._sysfs.read(self.path), loop.time())
                await sleep_until(interval(), stop)
        finally:
            if watch is not None:
                with contextlib.suppress(ValueError):  # already removed: the file went away
                    loop.remove_reader(watch.fileno())
                watch.close()

    def _arm(self, loop: asyncio.AbstractEventLoop,
             fired: asyncio.Event) -> TriggerWatch | None:
        if self._trigger is None:
            return None
        try:
            watch = TriggerWatch(self._sysfs, self.path, *self._trigger)
        except OSError as exc:
            log.warning("psi_path", path="poll", reason=f"arming the trigger failed: {exc}")
            self.mode = "poll"
            return None

        def on_ready() -> None:
            if watch.gone():
                log.warning("psi_path", path="poll", reason="the trigger's file went away")
                loop.remove_reader(watch.fileno())
                self.mode = "poll"
            fired.set()  # either way the watch must look now

        loop.add_reader(watch.fileno(), on_ready)
        return watch


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
