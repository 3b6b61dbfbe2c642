"""The token bucket every eviction passes through, whichever plugin asked for it.

``burst`` tokens at most; one token comes back per ``interval`` seconds. Whole intervals are
counted from an anchor time rather than by adding fractions of a token, so the boundaries are
exact: with ``interval`` 10 a token taken at 0 is back at 10.0, not at 9.999 or 10.001. Time is
passed in, from the caller's clock. A clock that goes back restarts the interval being refilled
from the earlier time: it never mints a token, and a wait never exceeds one interval.
"""

from __future__ import annotations

import math


def _check(burst: int, interval: float) -> None:
    if burst < 1 or not interval > 0:
        raise ValueError("a token bucket needs burst >= 1 and interval > 0")


class TokenBucket:
    def __init__(self, burst: int, interval: float, now: float) -> None:
        _check(burst, interval)
        self._burst = burst
        self._interval = interval
        self._tokens = burst
        # Start of the interval now being refilled; meaningful only below burst.
        self._anchor = now

    def configure(self, burst: int, interval: float, now: float) -> None:
        """New limits (a reload); tokens above the new burst are dropped. The interval being
        refilled keeps its start: the time already waited counts under the new interval."""
        _check(burst, interval)
        if (burst, interval) == (self._burst, self._interval):
            return
        self._refill(now)
        self._burst, self._interval = burst, interval
        self._tokens = min(self._tokens, burst)

    def _refill(self, now: float) -> None:
        if self._tokens >= self._burst or now < self._anchor:
            self._anchor = now
            return
        gained = math.floor((now - self._anchor) / self._interval)
        if gained <= 0:
            return
        self._tokens = min(self._burst, self._tokens + gained)
        self._anchor = now if self._tokens >= self._burst else \
            self._anchor + gained * self._interval

    def available(self, now: float) -> int:
        self._refill(now)
        return self._tokens

    def take(self, now: float) -> bool:
        """One token, if there is one."""
        self._refill(now)
        if self._tokens <= 0:
            return False
        if self._tokens >= self._burst:
            self._anchor = now
        self._tokens -= 1
        return True

    def give_back(self, now: float) -> None:
        """Return a token taken for an eviction that did not happen (refused, pod gone)."""
        self._refill(now)
        self._tokens = min(self._burst, self._tokens + 1)

    def wait(self, now: float) -> float:
        """Seconds until a token is available (0 when one is)."""
        self._refill(now)
        if self._tokens > 0:
            return 0.0
        return max(self._anchor + self._interval - now, 0.0)
