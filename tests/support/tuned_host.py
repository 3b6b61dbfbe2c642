"""A cgroup v2 fake host whose reclaimed pod has a raised ``memory.wmark_ratio``, and the
mitigation service built over it in enforce mode (the tune rung's setting)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import ENFORCE, Config
from reconciler.detection.signals import Board
from reconciler.host.probe import probe_host
from reconciler.host.statefile import state_file
from reconciler.host.sysfs import SysFs
from reconciler.kube import KubeActions, KubernetesConfig
from reconciler.loops.common import ManagedCache
from reconciler.loops.memory_squeeze import GuardSqueeze
from reconciler.mitigation.service import Mitigation, build_mitigation
from tests.support.fakesys import FakeHost

BATCH = "batch-0000-4000-8000-000000000000"


@dataclass
class TunedHost:
    wmark: Path
    """The reclaimed pod's ``memory.wmark_ratio``, at 95 to start with."""
    board: Board
    mitigation: Mitigation
    state_path: str
    """Where the mitigation keeps its notes."""


def tuned_host(tmp_path: Path) -> TunedHost:
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
    state_path = str(tmp_path / "state")
    board = Board()
    mitigation = build_mitigation(
        lambda: cfg, board, state, sysfs, info, audit,
        kube=KubeActions(None, KubernetesConfig(), audit), node="node-a",
        squeeze=GuardSqueeze(), evictor=None, managed=ManagedCache(),
        notes=state_file(state_path))
    return TunedHost(wmark, board, mitigation, state_path)
