"""Drift repair of oom_score_adj for a container whose processes sit in cgroups of its own
(cgroup v2, fake tree): a cgroup that passes its controllers down holds no process (the "no
internal process" rule), so a container that makes cgroups below its own (Docker in Docker, a
systemd inside) lists none of them in its own ``cgroup.procs``."""

from __future__ import annotations

from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import read_meminfo
from reconciler.host.sysfs import SysFs
from reconciler.loops.drift import DriftLoop
from tests.support.fakesys import GIB, FakeHost

UID = "33333333-0000-0000-0000-0000000000d1"


def test_the_processes_below_a_container_get_its_score(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2, driver="systemd")
    host.set_numa([(8 * GIB, 16 * GIB, 100)])
    pod = host.add_pod(UID, tier="besteffort", memory_limit=1 * GIB)
    container = host.cg("memory", pod.containers[0].rel)
    pid = pod.containers[0].pids[0]
    (container / "init").mkdir()
    (container / "init/cgroup.procs").write_text(f"{pid}\n")
    (container / "cgroup.procs").write_text("")
    state = NodeState()
    state.replace_all(*host.nri())
    sysfs = SysFs(tmp_path, AuditLog(MemoryAuditSink()))
    cfg = Config()
    loop = DriftLoop(lambda: cfg, state, sysfs, layout_for(sysfs),
                     read_meminfo(sysfs).get("MemTotal", 0))
    loop.cycle(0.0)
    assert (tmp_path / f"proc/{pid}/oom_score_adj").read_text().strip() == "1000"
