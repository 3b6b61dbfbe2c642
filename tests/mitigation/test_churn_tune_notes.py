"""The tune rung held engaged for long while reclaimed pods come and go (CronJobs, CI runners):
the state file keeps notes of the ``memory.wmark_ratio`` files of the pods there now, not of
every pod the rung ever lowered."""

from __future__ import annotations

from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.detection.pods import PodIndex
from reconciler.detection.signals import Level
from reconciler.host.probe import probe_host
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_squeeze import GuardSqueeze
from reconciler.mitigation.actions import WMARK_NOTES, Cause, TuneAction
from tests.support.builders import LEVEL
from tests.support.fakesys import FakeHost, FakePod

PODS = 200


def reclaimed_pod(host: FakeHost, index: int) -> FakePod:
    pod = host.add_pod(f"{index:08x}-0000-4000-8000-000000000000", tier="besteffort",
                       name=f"job-{index}", annotations={LEVEL: "reclaimed_cores"})
    (host.cg("memory", host.pod_rel("besteffort", pod.info.uid)) / "memory.wmark_ratio"
     ).write_text("95\n")
    return pod


async def test_the_notes_of_pods_gone_while_the_rung_is_engaged_do_not_pile_up(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2, driver="systemd")
    # The kernel has memory.wmark_ratio (veLinux, Anolis) where the root's children have it.
    (host.tier_dir("guaranteed") / "memory.wmark_ratio").write_text("0\n")
    staying = reclaimed_pod(host, 0)
    sysfs = SysFs(tmp_path, AuditLog(MemoryAuditSink()))
    state = NodeState()
    state.replace_all(*host.nri())
    info = probe_host(sysfs)
    notes = StateFile(None)
    cfg = Config()
    action = TuneAction(lambda: cfg, GuardSqueeze(), sysfs, info, PodIndex(state, info.cgroup),
                        lambda: True, notes)
    fresh = Cause(Level.LOW)  # no reading: counts as fresh pressure, each repeat tightens
    assert (await action.engage(fresh, dry_run=False)).result == "done"
    for index in range(1, PODS + 1):
        job = reclaimed_pod(host, index)
        state.replace_all(*host.nri())
        assert (await action.repeat(fresh, dry_run=False)).result == "done"
        host.remove_pod(job)
        state.replace_all(*host.nri())
    await action.repeat(fresh, dry_run=False)
    staying_file = (f"/sys/fs/cgroup/{host.pod_rel('besteffort', staying.info.uid)}/"
                    "memory.wmark_ratio")
    assert list(notes.entries(WMARK_NOTES)) == [staying_file]
    # The release still gives the pod that stayed its value back.
    assert (await action.release(fresh, dry_run=False)).result == "done"
    assert (tmp_path / staying_file.lstrip("/")).read_text() == "95"
    assert notes.entries(WMARK_NOTES) == {}
