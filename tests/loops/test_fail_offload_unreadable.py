"""One offline container whose ``memory.stat`` the kernel refuses to read (EISDIR here; EACCES,
EIO alike) is left out of offloading, said once while it lasts; the other containers are still
offloaded at every cycle."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.loops.offload_loop import OffloadLoop
from tests.support.builders import LEVEL
from tests.support.fakesys import FakeHost
from tests.support.offload import PRESSURE, stat_text


def offline_container(host: FakeHost, name: str) -> Path:
    pod = host.add_pod(f"{name}-0000-4000-8000-000000000000", tier="besteffort", name=name,
                       annotations={LEVEL: "reclaimed_cores"})
    d = host.cg("memory", pod.containers[0].rel)
    (d / "memory.stat").write_text(stat_text())
    (d / "memory.pressure").write_text(PRESSURE.format(some=0))
    (d / "memory.reclaim").write_text("")
    return d


def test_one_containers_unreadable_memory_stat_leaves_the_others_offloaded(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2, driver="systemd")
    (host.tier_dir("guaranteed") / "memory.reclaim").write_text("")
    (tmp_path / "proc/meminfo").write_text("MemTotal: 4194304 kB\nSwapTotal: 0 kB\n")
    odd = offline_container(host, "odd")
    batch = offline_container(host, "batch")
    (odd / "memory.stat").unlink()
    (odd / "memory.stat").mkdir()  # a read the kernel refuses
    cfg = Config()
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, enabled=True))
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    state = NodeState()
    state.replace_all(*host.nri())
    loop = OffloadLoop(lambda: cfg, state, sysfs, probe_host(sysfs), AuditLog(sink))
    with capture_logs() as logs:
        for t in range(4):
            loop.cycle(5.0 * t)
    assert (batch / "memory.reclaim").read_text() != ""
    assert (odd / "memory.reclaim").read_text() == ""
    said = [e for e in logs if e["event"] == "offload_unreadable"]
    assert [e["error"].split(":")[0] for e in said] == ["EISDIR"]
    assert [e for e in logs if e["event"] == "reconciler_loop_failed"] == []
