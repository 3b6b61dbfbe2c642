"""cgroup v1 whose memory controller has ``memory.pressure_level`` but refuses to register a
notification through ``cgroup.event_control``: the host has no memcg pressure events, said with
the reason, and the node-wide readings drive the ladder in their place."""

from __future__ import annotations

from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.cli.probe import report
from nri_plugin.config.schema import Config
from reconciler.detection.notified import pressure_level_problem
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.mitigation.service import counting_on
from tests.support.fakesys import GIB, FakeHost, refuse_writes, write


def test_a_refused_registration_leaves_the_host_without_memcg_events(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=1)
    host.set_numa([(8 * GIB, 16 * GIB, 1000)])
    memory = host.cg("memory", "")
    write(memory / "memory.pressure_level", "")
    # A file that still opens but whose writes the kernel refuses (EACCES).
    refuse_writes(memory / "cgroup.event_control")
    info = probe_host(SysFs(tmp_path, AuditLog(MemoryAuditSink())))
    assert not info.memcg.pressure_level
    problem = pressure_level_problem(info)
    assert "cgroup.event_control" in problem
    assert "EACCES" in problem
    cfg = Config()
    assert report(cfg, info)["features"]["detection.pressure_level"] == {
        "runs": False, "detail": problem}
    # Without the memcg events, the node-wide readings are what tells (node_signals = auto).
    assert counting_on(lambda: cfg, info)().node


def test_a_registration_taken_keeps_memcg_events(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=1)
    memory = host.cg("memory", "")
    write(memory / "memory.pressure_level", "")
    write(memory / "cgroup.event_control", "")
    info = probe_host(SysFs(tmp_path, AuditLog(MemoryAuditSink())))
    assert info.memcg.pressure_level
    assert pressure_level_problem(info) == ""
