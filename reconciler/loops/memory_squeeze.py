"""The mitigation ladder's squeeze of the reclaimed (BestEffort) tier.

While the mitigation ladder squeezes the tier (:class:`GuardSqueeze`, its "tune memcg" rung),
the memory guard (:mod:`reconciler.loops.memory_guard`) holds the tier below the usage it had
when the ladder first asked::

    tight = max(usage - squeeze.step_bytes, squeeze.floor_bytes,
                anonymous memory of the tier + squeeze.step_bytes)

a step lower on each later ask (every repeat on fresh pressure carries a new ``tightening``
number: the same formula with the limit held in place of the usage), and at the cycles in
between held where it is, raised only to stay ``step_bytes`` above the tier's anonymous memory
(``tight = max(tight, anonymous + step_bytes)``). ``tight`` is the v1 limit (``cap = min(cap,
tight)``) or the v2 ``memory.high`` (``high = min(high, tight)``, ``memory.max`` unchanged),
whether or not the guard holds a standing cap: the offline tier reclaims its own page cache
(v1) or is throttled and reclaims (v2) instead of pushing the node into reclaim that hits
online pods.

The squeeze takes page cache, not anonymous memory (which without swap cannot be reclaimed: the
kernel would refuse the limit, or OOM-kill offline pods for a rung meant to be mild): the tight
value stays a step above it. It is not lowered again without an ask: lowered at every cycle, it
took an offline job that kept growing its anonymous memory down to its limit after the pressure
had ended, and the kernel killed it. A v2 squeeze without ``spare_anonymous`` drops that term:
at ``memory.high`` the kernel throttles and never kills, so a growing job is held where it is.
Clearing the squeeze wakes the guard, which writes the unsqueezed values at once.

A step above the anonymous memory is not enough on v1 for a job that grows: a limit is hard
there, and an offline job growing its buffers at 1 GiB/s reached the tight limit before the
guard's next cycle raised it, and the kernel killed it (``docs/effectiveness.md``, ``--seed
567``: 2 of 16 windows beside the agent). So before a v1 squeeze writes the limit, the guard
turns the tier's OOM killer off (``oom_kill_disable`` in :data:`OOM_CONTROL`, noted and given
back when the squeeze ends, after the limit is raised): a task at the limit then waits, as at
v2's ``memory.high``, until the guard raises the limit a step above the tier's anonymous
memory, which it checks every :data:`PAUSED_RECHECK_S` while squeezed. A tier whose OOM killer
cannot be turned off is not squeezed. ``kubepods``' own limit and the machine's OOM killer are
untouched: a node out of memory still kills the offline pods first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from common.aio import Callbacks
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.host.values import PAGE_SIZE, same_bytes

log = structlog.get_logger("nri_qos.reconciler")


@dataclass(frozen=True, slots=True)
class Squeeze:
    """A tighter reclaimed tier, asked for by the mitigation ladder while interference lasts."""

    # How far below its current usage the tier is held.
    step_bytes: int
    # Never below this.
    floor_bytes: int
    # Why (the detector and its reading), for the audit trail.
    reason: str
    # Which ask this is: a new number takes the tier a step lower (the first: below its usage).
    tightening: int = 0
    # Keep the tight limit a step above the tier's anonymous memory (always on v1: see the
    # module doc).
    spare_anonymous: bool = True


class GuardSqueeze:
    """The ladder's handle on the guard; safe from any thread. A change calls the subscribers
    (the guard's wake-up), so it takes effect at once rather than at the next period."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: Squeeze | None = None
        self._changed = Callbacks()

    def current(self) -> Squeeze | None:
        with self._lock:
            return self._current

    def set(self, squeeze: Squeeze | None) -> bool:
        """Squeeze (or, with None, release) the tier; True when that changed something."""
        with self._lock:
            changed = self._current != squeeze
            self._current = squeeze
        if changed:
            self._changed.call()
        return changed

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        return self._changed.subscribe(callback)


OOM_CONTROL = "memory.oom_control"
"""cgroup v1: the tier's ``oom_kill_disable`` (see the module doc)."""

PAUSED_RECHECK_S = 1.0
"""The guard's period while a v1 squeeze holds the tier with its OOM killer off: a task at the
limit waits at most this long for the limit to be raised."""


def kill_disabled(text: str) -> str | None:
    """``oom_kill_disable`` of a v1 ``memory.oom_control``, as the kernel shows the file or as
    it was written (a bare ``0`` or ``1``); None when it is neither."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill_disable":
            return value.strip()
    bare = text.strip()
    return bare if bare in ("0", "1") else None


def same_kill_setting(current: str, desired: str) -> bool:
    """The comparator of :data:`OOM_CONTROL` writes."""
    return kill_disabled(current) == desired.strip()


def squeezed(usage: int, anonymous: int, squeeze: Squeeze) -> int:
    """The tier's tight limit when the ladder asks (see the module doc), in whole pages."""
    tight = max(usage - squeeze.step_bytes, squeeze.floor_bytes, anonymous + squeeze.step_bytes)
    return tight // PAGE_SIZE * PAGE_SIZE


def held(previous: int, anonymous: int, squeeze: Squeeze) -> int:
    """The tight limit at a cycle without a new ask: where it was, a step above the tier's
    anonymous memory at least, in whole pages."""
    return max(previous, (anonymous + squeeze.step_bytes) // PAGE_SIZE * PAGE_SIZE)


class KillHold:
    """cgroup v1: the tier's OOM killer off while a squeeze holds its limit (see the module
    doc), its value before noted in ``section`` of the state file beside the guard's limits."""

    def __init__(self, sysfs: SysFs, notes: StateFile, section: str) -> None:
        self._sysfs = sysfs
        self._notes = notes
        self._section = section
        # Whether a squeeze holds the tier with its OOM killer off.
        self.off = False
        self._warned: str | None = None

    def hold(self, tier: str) -> bool:
        """Before a squeezed limit is written: the killer off; False, and one warning, when it
        cannot be (the squeeze is then not written)."""
        path = f"{tier}/{OOM_CONTROL}"
        failure = None
        if path not in self._notes.entries(self._section):
            text = self._sysfs.read(path)
            value = None if text is None else kill_disabled(text)
            if value is None:
                failure = f"no {OOM_CONTROL} to read"
            elif not self._notes.remember(self._section, path, value):
                failure = "the state file refused the note"
        if failure is None:
            outcome = self._sysfs.write_if_changed(
                path, "1", "memory guard: a task at the squeezed limit waits for the guard to "
                "raise it instead of being OOM-killed", same=same_kill_setting)
            if outcome in (Outcome.WRITTEN, Outcome.UNCHANGED, Outcome.OBSERVED):
                self.off = True
                self._warned = None
                return True
            failure = f"writing {OOM_CONTROL}: {outcome.value}"
        if self._warned != failure:
            self._warned = failure
            log.warning("memory_guard_squeeze_skipped", path=path, reason=failure,
                        why="a hard limit at a growing job's memory would OOM-kill it")
        return False

    def give_back(self, tier: str, reason: str) -> None:
        """Once the limit is raised: the killer as it was before the first squeeze."""
        self.off = False
        restore_file(self._sysfs, self._notes, self._section, f"{tier}/{OOM_CONTROL}", reason)


def restore_file(sysfs: SysFs, notes: StateFile, section: str, path: str,
                 reason: str) -> Outcome | None:
    """Writes back the value noted for a tier file in ``section`` (compared as the kernel keeps
    it; never held back by observe mode), forgetting the note once the file has it or is gone;
    the outcome, None when nothing was noted."""
    value = notes.entries(section).get(path)
    if value is None:
        return None
    same = same_kill_setting if path.endswith(f"/{OOM_CONTROL}") else same_bytes
    outcome = sysfs.unobserved().write_if_changed(path, value, reason, same=same)
    if outcome in (Outcome.WRITTEN, Outcome.UNCHANGED, Outcome.GONE):
        notes.forget(section, path)
    return outcome
