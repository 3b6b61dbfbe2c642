"""One pod's file the kernel refuses to read (EACCES, EIO, EOPNOTSUPP, EISDIR ...) is that pod's
reading only: the pod is unknown for that detector, said once while the refusal lasts, and every
other pod is still judged at every cycle."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from reconciler.detection.signals import Level, pod_scope
from reconciler.host import sysfs as sysfs_module
from tests.support.detection_env import Setup, pod_pressure, uid
from tests.support.fakesys import GIB, MIB


def refuse_reads(monkeypatch: pytest.MonkeyPatch, code: int, suffix: str) -> None:
    """Reads of a file whose real path ends with ``suffix`` fail with ``code``."""
    read = sysfs_module.read_file_bytes

    def refusing(real: str) -> bytes | None:
        if real.endswith(suffix):
            raise OSError(code, os.strerror(code))
        return read(real)

    monkeypatch.setattr(sysfs_module, "read_file_bytes", refusing)


@pytest.mark.parametrize("code", [errno.EACCES, errno.EIO, errno.EOPNOTSUPP])
def test_one_pods_unreadable_memory_stat_leaves_the_other_pods_judged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    s = Setup(tmp_path, refaults=True, entry_samples=1)
    odd = s.pod("odd", "shared_cores", request=100 * MIB, anon=MIB, tier="burstable")
    web = s.pod("web", "shared_cores", request=100 * MIB, anon=MIB, tier="burstable")
    loop = s.loop()
    refuse_reads(monkeypatch, code, f"{uid('odd')}/memory.stat")
    with capture_logs() as logs:
        for t in range(5):
            s.refaults(web, t * 6000)  # 6,000 pages a second read again, 1 GiB anonymous
            loop.cycle(float(t))
    reason = f"memory.stat unreadable: {errno.errorcode[code]}: {os.strerror(code)}"
    for detector in ("rss_overuse", "refault"):
        odd_reading = s.reading(detector, pod_scope(uid("odd")))
        assert odd_reading is not None
        assert (odd_reading.level, odd_reading.reason) == (Level.UNKNOWN, reason)
        assert [r for r in s.board.current() if r.detector == detector
                and r.scope.endswith("*")] == []
    # the other pod is judged on what its file says now
    assert s.level("refault", pod_scope(uid("web"))) is Level.MEDIUM
    assert s.level("rss_overuse", pod_scope(uid("web"))) is Level.HIGH
    # said once per detector, not at every cycle; no traceback of a failed detector
    unknown = [e for e in logs if e["event"] == "detector_unknown"]
    assert sorted(e["detector"] for e in unknown) == ["refault", "rss_overuse"]
    assert [e for e in logs if e["event"] == "detector_failed"] == []
    assert len(s.sink.named("detector_unknown")) == 2
    # readable again: judged again
    monkeypatch.undo()
    s.refaults(odd, 0)
    loop.cycle(5.0)
    assert s.level("rss_overuse", pod_scope(uid("odd"))) is Level.HIGH


def test_one_pods_pressure_file_refused_leaves_the_other_pods_psi_judged(
        tmp_path: Path) -> None:
    s = Setup(tmp_path, version=2, entry_samples=1)
    odd = s.pod("odd", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    web = s.pod("web", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    loop = s.loop()
    (odd / "memory.pressure").unlink(missing_ok=True)
    (odd / "memory.pressure").mkdir()  # a read the kernel refuses (EISDIR here)
    with capture_logs() as logs:
        for t in range(3):
            (web / "memory.pressure").write_text(pod_pressure(t * 500_000))  # 50 % stalled
            loop.cycle(float(t))
    assert s.level("psi", pod_scope(uid("web"))) is Level.MEDIUM
    reading = s.reading("psi", pod_scope(uid("odd")))
    assert reading is not None
    assert reading.level is Level.UNKNOWN
    assert reading.reason.startswith("memory.pressure unreadable: EISDIR")
    assert [e["scope"] for e in logs if e["event"] == "detector_unknown"] == [
        pod_scope(uid("odd"))]


def test_a_pod_whose_cgroup_went_away_meanwhile_is_not_unknown_nor_audited(
        tmp_path: Path) -> None:
    s = Setup(tmp_path, refaults=True, entry_samples=1)
    gone = s.pod("gone", "shared_cores", request=100 * MIB, anon=MIB, tier="burstable")
    web = s.pod("web", "shared_cores", request=100 * MIB, anon=MIB, tier="burstable")
    loop = s.loop()
    loop.cycle(0.0)
    # the pod leaves: kubelet removed its cgroups, the runtime's events are still to come
    shutil.rmtree(gone)
    with capture_logs() as logs:
        s.refaults(web, 6000)
        loop.cycle(1.0)
    assert [r for r in s.board.current() if r.pod_uid == uid("gone")] == []
    assert [e for e in logs if e["event"] == "detector_unknown"] == []
    assert s.sink.named("detector_unknown") == []
    assert s.level("refault", pod_scope(uid("web"))) is Level.MEDIUM
    assert s.level("rss_overuse", pod_scope(uid("web"))) is Level.HIGH


def test_a_file_missing_from_a_pod_cgroup_still_there_is_unknown(tmp_path: Path) -> None:
    """A controller not enabled for the pod's cgroup: the cgroup is there, its file is not."""
    s = Setup(tmp_path, version=2, entry_samples=1)
    odd = s.pod("odd", "shared_cores", request=GIB, anon=MIB, tier="burstable")
    (odd / "memory.pressure").unlink(missing_ok=True)
    (odd / "memory.stat").unlink()
    loop = s.loop()
    for t in range(3):
        loop.cycle(float(t))
    for detector, name in (("psi", "memory.pressure"), ("rss_overuse", "memory.stat")):
        reading = s.reading(detector, pod_scope(uid("odd")))
        assert reading is not None
        assert (reading.level, reading.reason) == (Level.UNKNOWN, f"{name} is gone")
    assert len(s.sink.named("detector_unknown")) == 2
