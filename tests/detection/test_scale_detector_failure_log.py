"""A per-pod detector that fails at every cycle, as long as one pod of the node keeps a file the
kernel refuses to read (a pressure file of a cgroup with ``cgroup.pressure`` set to 0 answers
EOPNOTSUPP): its traceback is logged when the failure starts, not at every cycle."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from reconciler.detection.service import FAILED_PODS
from reconciler.detection.signals import Level
from tests.support.detection_env import Setup, pod_pressure
from tests.support.fakesys import GIB, MIB


def test_a_detector_failing_every_cycle_logs_its_traceback_once_per_failure(
        tmp_path: Path) -> None:
    s = Setup(tmp_path, version=2)
    odd = s.pod("odd", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    loop = s.loop()
    (odd / "memory.pressure").unlink(missing_ok=True)
    (odd / "memory.pressure").mkdir()  # read refused (EISDIR here)
    with capture_logs() as logs:
        for second in range(600):
            loop.cycle(float(second))
        assert s.level("psi", FAILED_PODS) is Level.UNKNOWN
        (odd / "memory.pressure").rmdir()
        (odd / "memory.pressure").write_text(pod_pressure())
        loop.cycle(600.0)
        assert s.reading("psi", FAILED_PODS) is None
        (odd / "memory.pressure").unlink()
        (odd / "memory.pressure").mkdir()
        loop.cycle(601.0)
    failed = [e for e in logs if e["event"] == "detector_failed"]
    assert [e["detector"] for e in failed] == ["psi", "psi"]
    assert all(e["exc_info"] for e in failed)
