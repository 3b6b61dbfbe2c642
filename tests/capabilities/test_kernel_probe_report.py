"""What ``nri-qos probe`` says of a detector on a host whose kernel lacks the feature it reads
must be what the agent does there."""

from __future__ import annotations

import shutil
from pathlib import Path

from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.cli.probe import report
from nri_plugin.config.schema import Config
from reconciler.detection.publisher import Publisher
from reconciler.detection.service import DetectorsLoop
from reconciler.detection.signals import Board
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from tests.support.fakesys import GIB, FakeHost, write


def test_a_kernel_without_numa_is_reported_without_numa_free_as_the_agent_runs(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=1)
    host.set_numa([(8 * GIB, 16 * GIB, 1000)])
    node = tmp_path / "sys/devices/system/node"
    shutil.rmtree(node)
    write(tmp_path / "proc/meminfo", "MemTotal: 16777216 kB\nMemFree: 8388608 kB\n")
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    info = probe_host(sysfs)
    cfg = Config()
    publisher = Publisher(Board(), AuditLog(sink), lambda: cfg.detection)
    loop = DetectorsLoop(lambda: cfg, publisher, NodeState(), sysfs, info)
    with capture_logs() as logs:
        loop.cycle(0.0)
    said = [e for e in logs if e["event"] == "detector_unavailable"
            and e["detector"] == "numa_free"]
    assert said
    assert "no NUMA nodes in sysfs" in said[0]["reason"]
    feature = report(cfg, info)["features"]["detection.numa_free"]
    assert feature["runs"] is False
    assert "no NUMA nodes in sysfs" in feature["detail"]
