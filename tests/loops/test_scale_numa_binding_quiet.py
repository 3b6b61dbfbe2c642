"""NUMA binding on a busy node whose page cache fills every NUMA node for days: that no node has
headroom is said when it starts and when it ends, not at every cycle (every ten seconds, and at
every container start on a node where pods come and go every few seconds)."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.sysfs import SysFs
from reconciler.loops.numa_binding import NumaBindingLoop
from tests.support.fakesys import GIB, FakeHost

LOW = 1000  # pages; the 4 GiB floor dominates
SHORT = [(2 * GIB, 64 * GIB, LOW), (3 * GIB, 64 * GIB, LOW)]


def test_no_node_with_headroom_is_said_when_it_starts_and_when_it_ends(tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    offline = host.add_pod("11111111-0000-4000-8000-000000000001", tier="besteffort")
    state = NodeState()
    state.replace_all(*host.nri())
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    config = Config()
    loop = NumaBindingLoop(lambda: config, state, sysfs, layout_for(sysfs), AuditLog(sink))
    host.set_numa(SHORT)
    with capture_logs() as logs:
        for cycle in range(360):  # an hour of cycles
            loop.cycle(cycle * 10.0)
        said = [e["event"] for e in logs if e["event"].startswith("numa_binding")]
        assert said == ["numa_binding_unchanged"]
        host.set_numa([(20 * GIB, 64 * GIB, LOW), (3 * GIB, 64 * GIB, LOW)])
        loop.cycle(3600.0)
        loop.cycle(3610.0)
        host.set_numa(SHORT)
        loop.cycle(3620.0)
        loop.cycle(3630.0)
    said = [e["event"] for e in logs if e["event"].startswith("numa_binding")]
    assert said == ["numa_binding_unchanged", "numa_binding_headroom", "numa_binding_unchanged"]
    assert [r["mems"] for r in sink.named("numa_binding")] == ["0"]
    cpuset = host.cg("cpuset", offline.containers[0].rel) / "cpuset.mems"
    assert cpuset.read_text().strip() == "0"
