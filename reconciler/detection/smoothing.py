"""Hysteresis: raw samples in, the level a detector reports out.

Per (detector, scope):

* a level is **entered** after ``entry_samples`` consecutive samples at or above it, or at once
  when the sample comes from the kernel's own notification (a PSI trigger, a memcg pressure
  event), which the kernel has already smoothed over its window;
* a level is **left** only after the raw level has stayed below it for ``cooldown_s`` (sample
  time), and then drops to the raw level: one quiet sample does not end pressure, and a signal
  flapping faster than the cooldown holds its level instead of flapping.

An ``unknown`` sample passes through at once and forgets the history: after it, levels are
entered again from scratch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from reconciler.detection.detectors import GRADED, Sample
from reconciler.detection.signals import Level, Reading


@dataclass(slots=True)
class _Track:
    level: Level = Level.NONE
    # Consecutive samples at or above LOW, MEDIUM, HIGH.
    runs: list[int] = field(default_factory=lambda: [0, 0, 0])
    # Sample time at which the raw level first fell below the level held.
    below_since: float | None = None


class Smoother:
    """The hysteresis of every (detector, scope); not thread-safe (one owner)."""

    def __init__(self) -> None:
        self._tracks: dict[tuple[str, str], _Track] = {}

    def update(self, sample: Sample, *, entry_samples: int, cooldown_s: float,
               triggered: bool = False) -> Reading:
        if sample.level is Level.UNKNOWN:
            self._tracks.pop(sample.key, None)
            return sample.reading(Level.UNKNOWN)
        track = self._tracks.setdefault(sample.key, _Track())
        raw = sample.level
        for i, level in enumerate(GRADED):
            track.runs[i] = track.runs[i] + 1 if raw >= level else 0
        entered = max((level for i, level in enumerate(GRADED)
                       if track.runs[i] >= entry_samples), default=Level.NONE)
        if triggered:
            entered = max(entered, raw)
        if entered > track.level:
            track.level, track.below_since = entered, None
        elif raw >= track.level:
            track.below_since = None
        else:
            if track.below_since is None:
                track.below_since = sample.at
            if sample.at - track.below_since >= cooldown_s:
                track.level, track.below_since = raw, None
        return sample.reading(track.level)

    def level(self, key: tuple[str, str]) -> Level:
        """The level held for a (detector, scope); NONE when unseen."""
        track = self._tracks.get(key)
        return Level.NONE if track is None else track.level

    def keep_only(self, detector: str, keys: Iterable[tuple[str, str]]) -> None:
        """Forget the detector's scopes not in ``keys`` (pods that went away)."""
        keep = set(keys)
        for key in [k for k in self._tracks if k[0] == detector and k not in keep]:
            del self._tracks[key]
