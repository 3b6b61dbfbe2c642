"""One reclaimed pod's ``memory.stat`` that the kernel refuses to read (EISDIR here; EACCES,
EIO alike) leaves that pod out of the drop-cache plan: the other pods' cache is still dropped."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.detection.pods import PodIndex
from reconciler.detection.signals import Level
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.mitigation.actions import Cause
from reconciler.mitigation.drop_cache import DropCacheAction
from tests.support.fakesys import MIB, FakeHost

LEVEL = "qos.nri-qos.io/level"


def reclaimed_pod(host: FakeHost, name: str, cache: int) -> Path:
    uid = f"{name}-0000-4000-8000-000000000000"
    host.add_pod(uid, tier="besteffort", name=name, annotations={LEVEL: "reclaimed_cores"})
    d = host.cg("memory", host.pod_rel("besteffort", uid))
    (d / "memory.stat").write_text(f"anon {MIB}\nfile {cache}\n")
    (d / "memory.current").write_text(f"{cache + MIB}\n")
    (d / "memory.reclaim").write_text("")
    return d


async def test_one_pods_unreadable_memory_stat_leaves_the_others_cache_dropped(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2, driver="systemd")
    (host.tier_dir("guaranteed") / "memory.reclaim").write_text("")
    odd = reclaimed_pod(host, "odd", 300 * MIB)
    big = reclaimed_pod(host, "big", 200 * MIB)
    (odd / "memory.stat").unlink()
    (odd / "memory.stat").mkdir()  # a read the kernel refuses
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    state = NodeState()
    state.replace_all(*host.nri())
    info = probe_host(sysfs)
    action = DropCacheAction(Config, sysfs, info, PodIndex(state, info.cgroup), AuditLog(sink))
    with capture_logs() as logs:
        result = await action.engage(Cause(Level.MEDIUM), dry_run=False)
    action.close()
    assert result.result == "done", result
    assert (big / "memory.reclaim").read_text() == str(200 * MIB)
    assert (odd / "memory.reclaim").read_text() == ""
    [said] = [e for e in logs if e["event"] == "drop_cache_stat_unreadable"]
    assert said["pod"] == "default/odd"
    assert said["reason"].startswith("memory.stat unreadable: EISDIR")
