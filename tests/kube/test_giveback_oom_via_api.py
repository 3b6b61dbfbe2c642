"""An oom_score_adj an annotation set through the API server goes back to kubelet's when the
annotation goes: the real kubernetes client watches a server that behaves like the API server,
and drift writes the container's processes' score, then gives kubelet's back."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.kube import PodWatcher
from reconciler.runner import build_loops, run_reconciler
from tests.support.fake_apiserver import FakeApiServer, api_client, client_config, make_pod
from tests.support.fakesys import GIB, MIB, FakeHost
from tests.support.polling import eventually

UID = "bbbbbbbb-0000-0000-0000-00000000000b"
OOM = "qos.nri-qos.io/oom-score-adj"
KUBELETS = 300


def annotate(value: str | None) -> Callable[[dict[str, Any]], None]:
    def mutate(pod: dict[str, Any]) -> None:
        annotations = pod["metadata"]["annotations"]
        if value is None:
            annotations.pop(OOM, None)
        else:
            annotations[OOM] = value

    return mutate


async def test_an_oom_score_annotation_removed_through_the_api_gives_kubelets_back(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host", version=2, driver="systemd")
    host.set_numa([(8 * GIB, 16 * GIB, 100)])
    pod = host.add_pod(UID, name="web-0", tier="burstable", memory_limit=512 * MIB)
    (container,) = pod.containers
    proc = host.root / "proc" / str(container.pids[0]) / "oom_score_adj"
    proc.write_text(f"{KUBELETS}\n")
    state = NodeState()
    pods, containers = host.nri()
    state.replace_all(pods, [dataclasses.replace(c, oom_score_adj=KUBELETS) for c in containers])
    base = Config()
    # Long periods: only the wake-ups from the pod watch can explain prompt writes.
    cfg = dataclasses.replace(
        base,
        reconciler=dataclasses.replace(base.reconciler, drift_interval_s=3600.0,
                                       resctrl_interval_s=3600.0),
        memory_guard=dataclasses.replace(base.memory_guard, interval_s=3600.0),
        numa=dataclasses.replace(base.numa, interval_s=3600.0),
    )
    audit = AuditLog(MemoryAuditSink())
    sysfs = SysFs(host.root, audit)
    stop = asyncio.Event()

    def score() -> int | None:
        # None while drift's write is under way: a plain file, unlike /proc, is read empty then.
        text = proc.read_text()
        return int(text) if text.strip() else None

    with FakeApiServer() as server, api_client(kube := client_config(
            tmp_path, server, request_timeout_s=5.0, retry_max_s=0.2)) as api:
        server.add_pod(make_pod("web-0", uid=UID, node="node-a",
                                memory={"c0": ("256Mi", "512Mi")}))
        watcher = PodWatcher(api, kube, "node-a", initial_backoff_s=0.01)
        loops = build_loops(lambda: cfg, state, sysfs, probe_host(sysfs), None, audit)
        task = asyncio.create_task(run_reconciler(loops, state, stop, watcher,
                                                  read_keys=cfg.read_keys,
                                                  backoff_max=lambda: 60))
        try:
            await eventually(
                lambda: state.snapshot().containers[0].info.memory_request == 256 * MIB)
            assert score() == KUBELETS
            server.modify_pod("default", "web-0", annotate("500"))
            await eventually(lambda: score() == 500)
            server.modify_pod("default", "web-0", annotate(None))
            await eventually(lambda: score() == KUBELETS)
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
