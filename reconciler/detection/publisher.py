"""From samples to the board: smoothing, one reading set per detector, unknowns audited once.

Several paths feed one detector (the PSI of the node from the fast poll, the PSI of pods from
the periodic detectors), while :meth:`Board.publish` replaces a detector's readings as a whole;
the publisher keeps each detector's current readings and publishes their union. It is called
from the event loop (fast paths) and from the detectors' worker thread, hence one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable

import structlog

from common.audit import AuditLog
from reconciler.detection.config import DetectionConfig
from reconciler.detection.detectors import Sample
from reconciler.detection.signals import Board, Level, Reading
from reconciler.detection.smoothing import Smoother

log = structlog.get_logger("nri_qos.detection")


class Publisher:
    def __init__(self, board: Board, audit: AuditLog,
                 config: Callable[[], DetectionConfig]) -> None:
        self._board = board
        self._audit = audit
        self._config = config
        self._lock = threading.Lock()
        self._smoother = Smoother()
        self._current: dict[str, dict[str, Reading]] = {}
        # (detector, scope) -> the reason of the unknown reading audited for it
        self._unknown: dict[tuple[str, str], str] = {}

    def offer(self, detector: str, samples: Iterable[Sample], *, covers: str | None = "",
              triggered: bool = False) -> None:
        """Smooth ``samples`` (all of ``detector``) and publish. ``covers``: the scope prefix
        these samples cover completely (scopes of it without a sample are dropped: pods that
        went away); "" for every scope, None for none (a partial update)."""
        cfg = self._config()
        with self._lock:
            current = self._current.setdefault(detector, {})
            fresh: dict[str, Reading] = {}
            for sample in samples:
                reading = self._smoother.update(sample, entry_samples=cfg.entry_samples,
                                                cooldown_s=cfg.exit_cooldown_s,
                                                triggered=triggered)
                fresh[sample.scope] = reading
                self._note(reading)
            if covers is not None:
                for scope in [s for s in current if s.startswith(covers) and s not in fresh]:
                    del current[scope]
                    self._unknown.pop((detector, scope), None)
                self._smoother.keep_only(detector, [(detector, s) for s in current]
                                         + [(detector, s) for s in fresh])
            current.update(fresh)
            self._board.publish(detector, list(current.values()))

    def withdraw(self, detector: str, scope_prefix: str = "") -> None:
        """Drop the detector's readings whose scope starts with ``scope_prefix``."""
        self.offer(detector, (), covers=scope_prefix)

    def engaged(self, detectors: Collection[str],
                which: Callable[[Reading], bool] | None = None) -> bool:
        """Whether a reading of ``detectors`` on the board (one ``which`` accepts, given it) is
        at a level or entering one."""
        return self._board.engaged(detectors, which)

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from the publishing thread) when a level on the board changes."""
        return self._board.subscribe(callback)

    def level(self, detector: str, scope: str) -> Level:
        """The smoothed level held now (NONE when unseen)."""
        with self._lock:
            return self._smoother.level((detector, scope))

    def _note(self, reading: Reading) -> None:
        """Audit an unknown reading once per cause; say when the detector reads again."""
        key = reading.key
        if reading.level is Level.UNKNOWN:
            if self._unknown.get(key) == reading.reason:
                return
            self._unknown[key] = reading.reason
            log.warning("detector_unknown", detector=reading.detector, scope=reading.scope,
                        reason=reading.reason)
            self._audit.record("detector_unknown", detector=reading.detector,
                               scope=reading.scope, reason=reading.reason)
        elif self._unknown.pop(key, None) is not None:
            log.info("detector_recovered", detector=reading.detector, scope=reading.scope)
