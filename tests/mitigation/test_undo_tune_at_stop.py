"""The agent stops while the tune rung is engaged: the reclaimed pods get their
``memory.wmark_ratio`` back with the ladder's end, as the tier gets back what the squeeze took
(the memory guard's close): nobody watches the pressure that lowered it any more."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import ENFORCE, Config
from reconciler.detection.signals import NODE, Board, Level, Reading
from reconciler.host.probe import probe_host
from reconciler.host.statefile import state_file
from reconciler.host.sysfs import SysFs
from reconciler.kube import KubeActions, KubernetesConfig
from reconciler.loops.common import ManagedCache
from reconciler.loops.memory_squeeze import GuardSqueeze
from reconciler.mitigation.actions import WMARK_NOTES
from reconciler.mitigation.service import build_mitigation
from tests.support.fakesys import FakeHost
from tests.support.polling import eventually

BATCH = "batch-0000-4000-8000-000000000000"


async def test_a_stop_while_tuned_gives_the_reclaimed_pods_their_wmark_ratio_back(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host", version=2, driver="systemd")
    (host.tier_dir("guaranteed") / "memory.wmark_ratio").write_text("0\n")
    pod = host.add_pod(BATCH, tier="besteffort", name="batch",
                       annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
    wmark = host.cg("memory", host.pod_rel("besteffort", pod.info.uid)) / "memory.wmark_ratio"
    wmark.write_text("95\n")
    audit = AuditLog(MemoryAuditSink())
    sysfs = SysFs(host.root, audit)
    info = probe_host(sysfs)
    state = NodeState()
    state.replace_all(*host.nri())
    cfg = Config()
    cfg = dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, mode=ENFORCE))
    notes = state_file(str(tmp_path / "state"))
    board = Board()
    squeeze = GuardSqueeze()
    mitigation = build_mitigation(
        lambda: cfg, board, state, sysfs, info, audit,
        kube=KubeActions(None, KubernetesConfig(), audit), node="node-a", squeeze=squeeze,
        evictor=None, managed=ManagedCache(), notes=notes)
    stop = asyncio.Event()
    task = asyncio.create_task(mitigation.run(stop))
    try:
        board.publish("psi", [Reading("psi", NODE, Level.LOW, 20.0, 10.0, "percent", "x")])
        await eventually(lambda: wmark.read_text() == "80")
        assert "tune" in mitigation.state().engaged
    finally:
        stop.set()
        await asyncio.wait_for(task, 10.0)
    assert wmark.read_text() == "95"
    assert state_file(str(tmp_path / "state")).entries(WMARK_NOTES) == {}
