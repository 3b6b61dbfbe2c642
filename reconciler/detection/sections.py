"""Which detection paths are switched on, and how often each looks: one rule for all of them.

A path switched off (``[detection] enabled = false``, the reconciler off, or its detector in
``disabled``) keeps running so that a reload can switch it on again, but looks only every
:data:`SWITCHED_OFF_RECHECK_S`. A path whose readings are all calm looks every
``quiet_interval_s`` (:func:`paced`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from reconciler.detection.config import DetectionConfig
from reconciler.loops.base import ReconcilerConfig


class DetectionSections(Protocol):
    """The configuration sections detection reads."""

    @property
    def reconciler(self) -> ReconcilerConfig: ...

    @property
    def detection(self) -> DetectionConfig: ...


def active(cfg: DetectionSections, detector: str) -> bool:
    """Whether ``detector`` runs under ``cfg``."""
    return (cfg.reconciler.enabled and cfg.detection.enabled
            and detector not in cfg.detection.disabled)


SWITCHED_OFF_RECHECK_S = 10.0
"""How often a detection path that is switched off (``[detection] enabled = false``, or its
detector in ``disabled``) looks whether a reload switched it on: it has nothing to do until
then, and waking every ``interval_s`` costs a node the wake-ups all the same."""


def period(cfg: DetectionSections, *detectors: str) -> float:
    """``interval_s`` while any of ``detectors`` is active, else the switched-off recheck."""
    if any(active(cfg, name) for name in detectors):
        return cfg.detection.interval_s
    return max(cfg.detection.interval_s, SWITCHED_OFF_RECHECK_S)


def paced(cfg: DetectionSections, detectors: Collection[str], calm: bool) -> tuple[float, bool]:
    """The period of a path running ``detectors``, and whether it is the quiet one:
    ``quiet_interval_s`` (never shorter than ``interval_s``) while one of them is active and
    ``calm`` (no reading that says memory is short is at a level or entering one), else
    :func:`period`."""
    if calm and any(active(cfg, name) for name in detectors):
        return max(cfg.detection.interval_s, cfg.detection.quiet_interval_s), True
    return period(cfg, *detectors), False
