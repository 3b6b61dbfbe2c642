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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from common.aio import Callbacks
from reconciler.host.values import PAGE_SIZE


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


def squeezed(usage: int, anonymous: int, squeeze: Squeeze) -> int:
    """The tier's tight limit when the ladder asks (see the module doc), in whole pages."""
    tight = max(usage - squeeze.step_bytes, squeeze.floor_bytes, anonymous + squeeze.step_bytes)
    return tight // PAGE_SIZE * PAGE_SIZE


def held(previous: int, anonymous: int, squeeze: Squeeze) -> int:
    """The tight limit at a cycle without a new ask: where it was, a step above the tier's
    anonymous memory at least, in whole pages."""
    return max(previous, (anonymous + squeeze.step_bytes) // PAGE_SIZE * PAGE_SIZE)
