"""cgroup v2 hosts where a controller the loops need is not enabled in a parent's
``cgroup.subtree_control``: the kernel then gives the child cgroups none of its files. The loop
says so once and goes on with what it can do, instead of skipping every cycle in silence."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from nri_plugin.report.features import evaluate, kubernetes_feature
from reconciler.host.cgroups import layout_for
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_guard import MemoryGuardLoop
from reconciler.loops.numa_binding import NumaBindingLoop
from reconciler.loops.offload import offload_problem
from tests.support.fakesys import GIB, FakeHost
from tests.support.guard_config import standing

MEMORY_FILES = ("memory.current", "memory.max", "memory.high", "memory.low", "memory.min")


def test_a_tier_without_the_memory_controller_is_said_once(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2, driver="systemd")
    host.set_numa([(20 * GIB, 64 * GIB, 1000)])
    tier = host.tier_dir("besteffort")
    for name in MEMORY_FILES:
        (tier / name).unlink()
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit)
    cfg = standing()
    loop = MemoryGuardLoop(lambda: cfg, sysfs, layout_for(sysfs), audit)
    with capture_logs() as logs:
        for cycle in range(3):
            loop.cycle(5.0 * cycle)
    idle = [e for e in logs if e["event"] == "memory_guard_idle"]
    assert len(idle) == 1
    assert "memory controller" in idle[0]["reason"]
    assert "subtree_control" in idle[0]["reason"]
    assert sink.records == []
    # The controller enabled later: the guard caps the tier from then on.
    (tier / "memory.current").write_text(f"{GIB}\n")
    (tier / "memory.max").write_text("max\n")
    (tier / "memory.high").write_text("max\n")
    loop.cycle(20.0)
    assert len(sink.named("memory_guard_cap")) == 1


def test_reclaimed_pods_without_the_cpuset_controller_are_said_once(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2, driver="systemd")
    offline = host.add_pod("11111111-0000-0000-0000-000000000001", tier="besteffort",
                           containers=2)
    host.set_numa([(20 * GIB, 64 * GIB, 1000), (2 * GIB, 64 * GIB, 1000)])
    for container in offline.containers:
        (host.cg("cpuset", container.rel) / "cpuset.mems").unlink()
    state = NodeState()
    state.replace_all(*host.nri())
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    loop = NumaBindingLoop(lambda: Config(), state, sysfs, layout_for(sysfs), AuditLog(sink))
    with capture_logs() as logs:
        for cycle in range(3):
            loop.cycle(10.0 * cycle)
    said = [e for e in logs if e["event"] == "numa_binding_unavailable"]
    assert len(said) == 1
    assert "cpuset.mems" in said[0]["reason"]
    assert "subtree_control" in said[0]["reason"]
    assert sink.named("numa_binding") == []


def test_offloading_is_off_where_cgroups_have_no_memory_pressure(tmp_path: Path) -> None:
    # PSI off for cgroups (cgroup_disable=pressure): no cgroup has memory.pressure, the root's
    # included, while memory.reclaim is there.
    host = FakeHost(tmp_path, version=2, driver="systemd")
    (host.tier_dir("guaranteed") / "memory.reclaim").write_text("")
    (host.cgroup / "memory.pressure").unlink()
    cfg = Config()
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, enabled=True))
    info = probe_host(SysFs(tmp_path))
    problem = offload_problem(info)
    assert "memory.pressure" in problem
    found = evaluate(cfg, info, kubernetes_feature(cfg, None, ""))
    assert found["reconciler.offload"].runs is False
    assert found["reconciler.offload"].detail == problem
