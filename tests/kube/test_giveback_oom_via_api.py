"""An oom_score_adj an annotation set through the API server goes back to kubelet's when the
annotation goes: the real kubernetes client watches a server that behaves like the API server,
and drift writes the container's processes' score, then gives kubelet's back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from reconciler.host.sysfs import SysFs
from tests.support.fake_apiserver import FakeApiServer, make_pod
from tests.support.fakesys import MIB
from tests.support.pod_watch import annotate, reconciling, web_0, woken_by_the_watch_only
from tests.support.polling import eventually

UID = "bbbbbbbb-0000-0000-0000-00000000000b"
OOM = "qos.nri-qos.io/oom-score-adj"
KUBELETS = 300


async def test_an_oom_score_annotation_removed_through_the_api_gives_kubelets_back(
        tmp_path: Path) -> None:
    host, container = web_0(tmp_path / "host", UID)
    proc = host.root / "proc" / str(container.pids[0]) / "oom_score_adj"
    proc.write_text(f"{KUBELETS}\n")
    state = NodeState()
    pods, containers = host.nri()
    state.replace_all(pods, [dataclasses.replace(c, oom_score_adj=KUBELETS) for c in containers])
    audit = AuditLog(MemoryAuditSink())
    sysfs = SysFs(host.root, audit)

    def score() -> int | None:
        # None while drift's write is under way: a plain file, unlike /proc, is read empty then.
        text = proc.read_text()
        return int(text) if text.strip() else None

    with FakeApiServer() as server:
        server.add_pod(make_pod("web-0", uid=UID, node="node-a",
                                memory={"c0": ("256Mi", "512Mi")}))
        async with reconciling(tmp_path, server, woken_by_the_watch_only(), state, sysfs, audit):
            await eventually(
                lambda: state.snapshot().containers[0].info.memory_request == 256 * MIB)
            assert score() == KUBELETS
            server.modify_pod("default", "web-0", annotate(OOM, "500"))
            await eventually(lambda: score() == 500)
            server.modify_pod("default", "web-0", annotate(OOM, None))
            await eventually(lambda: score() == KUBELETS)
