"""A per-pod detector that fails at every cycle (a fault of its own, not a pod's file: one pod's
file the kernel refuses to read is that pod's unknown reading): its traceback is logged when the
failure starts, not at every cycle."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import pytest
from structlog.testing import capture_logs

from reconciler.detection import detectors as d
from reconciler.detection.service import FAILED_PODS
from reconciler.detection.signals import Level
from tests.support.detection_env import Setup, pod_pressure
from tests.support.fakesys import GIB, MIB


def broken(*args: object) -> NoReturn:
    raise RuntimeError("bug")


def test_a_detector_failing_every_cycle_logs_its_traceback_once_per_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup(tmp_path, version=2)
    odd = s.pod("odd", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    loop = s.loop()
    (odd / "memory.pressure").write_text(pod_pressure())
    with capture_logs() as logs:
        monkeypatch.setattr(d, "read_stall", broken)
        for second in range(600):
            loop.cycle(float(second))
        assert s.level("psi", FAILED_PODS) is Level.UNKNOWN
        monkeypatch.undo()
        (odd / "memory.pressure").write_text(pod_pressure())
        loop.cycle(600.0)
        assert s.reading("psi", FAILED_PODS) is None
        monkeypatch.setattr(d, "read_stall", broken)
        loop.cycle(601.0)
    failed = [e for e in logs if e["event"] == "detector_failed"]
    assert [e["detector"] for e in failed] == ["psi", "psi"]
    assert all(e["exc_info"] for e in failed)
