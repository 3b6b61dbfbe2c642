"""The drop-cache rung retried for long (a drop the kernel keeps refusing fails every round, and
the ladder engages it again while the level holds) while reclaimed pods come and go: what it
keeps of the pods it dropped is of the pods there now."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.detection.pods import PodIndex
from reconciler.detection.signals import Level
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.mitigation.actions import Cause
from reconciler.mitigation.drop_cache import DropCacheAction
from tests.support.builders import LEVEL
from tests.support.fakesys import MIB, FakeHost, FakePod

PODS = 40
CAUSE = Cause(Level.MEDIUM)


def reclaimed_pod(host: FakeHost, index: int) -> FakePod:
    pod = host.add_pod(f"{index:08x}-0000-4000-8000-000000000000", tier="besteffort",
                       name=f"job-{index}", annotations={LEVEL: "reclaimed_cores"})
    d = host.cg("memory", host.pod_rel("besteffort", pod.info.uid))
    (d / "memory.stat").write_text(f"anon {MIB}\nfile {300 * MIB}\n")
    (d / "memory.current").write_text(f"{301 * MIB}\n")
    (d / "memory.reclaim").write_text("")
    return pod


async def test_pods_gone_while_failed_rounds_are_retried_are_forgotten(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2, driver="systemd")
    (host.tier_dir("guaranteed") / "memory.reclaim").write_text("")
    stuck = reclaimed_pod(host, 0)
    reclaim = host.cg("memory", host.pod_rel("besteffort", stuck.info.uid)) / "memory.reclaim"
    reclaim.unlink()
    reclaim.mkdir()  # EISDIR: a write the kernel refuses at every round
    cfg = Config()
    cfg = dataclasses.replace(cfg, mitigation=dataclasses.replace(
        cfg.mitigation, drop_cache=dataclasses.replace(cfg.mitigation.drop_cache, max_pods=4)))
    sysfs = SysFs(tmp_path, AuditLog(MemoryAuditSink()))
    state = NodeState()
    state.replace_all(*host.nri())
    info = probe_host(sysfs)
    action = DropCacheAction(lambda: cfg, sysfs, info, PodIndex(state, info.cgroup),
                             AuditLog(MemoryAuditSink()))
    try:
        for index in range(1, PODS + 1):
            job = reclaimed_pod(host, index)
            state.replace_all(*host.nri())
            # The ladder engages a failed rung again (never a repeat) while the level holds.
            result = await action.engage(CAUSE, dry_run=False)
            assert result.result == "failed"
            assert "1 pod(s)" not in result.detail  # the new pod's cache went too
            host.remove_pod(job)
            state.replace_all(*host.nri())
        await action.engage(CAUSE, dry_run=False)
    finally:
        action.close()
    # Only the pods there now can be spared a second drop in this engagement.
    assert action._dropped <= {stuck.info.uid}
