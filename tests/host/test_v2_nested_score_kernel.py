"""Drift's oom_score_adj reaches the processes of a cgroup a container made below its own, on
this machine's kernel: a real process in a memcg nested in the container's (cgroup v1 here; on
cgroup v2 a container that makes cgroups of its own must put every process in them, the "no
internal process" rule, so its own ``cgroup.procs`` is empty), its real
``/proc/<pid>/oom_score_adj``. Skipped unless running as root with the v1 memory controller."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import PodMeta
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.sysfs import SysFs
from reconciler.loops.drift import DriftLoop
from tests.support.v1_memcg import NEEDS_V1_MEMORY, container_memcg, one_container

UID = "99999999-0000-4000-8000-0000000000d2"
CID = "d" * 64
KUBELETS = 300

pytestmark = NEEDS_V1_MEMORY


def test_a_process_in_a_cgroup_below_the_container_gets_the_score() -> None:
    with container_memcg("nriqos-nested-oom", "burstable", UID, CID,
                         oom_score_adj=KUBELETS) as made:
        inner = made.container / "init"
        inner.mkdir()
        process = made.processes[0]
        try:
            (inner / "cgroup.procs").write_text(str(process.pid))
            assert (made.container / "cgroup.procs").read_text() == ""
            state = one_container("burstable", UID, CID, oom_score_adj=KUBELETS)
            state.apply_meta(PodMeta(
                uid=UID, namespace="test", name="real",
                annotations=MappingProxyType({"qos.nri-qos.io/oom-score-adj": "500"}),
                labels=MappingProxyType({}), priority=0,
                memory_requests=MappingProxyType({}), memory_limits=MappingProxyType({})))
            config = Config()
            loop = DriftLoop(lambda: config, state, SysFs("/", AuditLog(MemoryAuditSink())),
                             CgroupLayout(1, "cgroupfs", mount=str(made.parent)), 1 << 30)
            loop.cycle(10.0)
            assert Path(f"/proc/{process.pid}/oom_score_adj").read_text().strip() == "500"
        finally:
            process.kill()
            process.wait()
            inner.rmdir()
