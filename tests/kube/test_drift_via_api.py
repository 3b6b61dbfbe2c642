"""An annotation changed through the API server reaches the running container: the real
kubernetes client watches a server that behaves like the API server, the node state merges the
change, drift wakes at once and writes the new level's settings into a fake host."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.kube import Api, KubernetesConfig, PodWatcher, build_api_client
from reconciler.runner import build_loops, run_reconciler
from tests.support.fake_apiserver import FakeApiServer, make_pod, write_kubeconfig
from tests.support.fakesys import GIB, FakeHost
from tests.support.pod_watch import annotate, reconciling, woken_by_the_watch_only

UID = "44444444-0000-0000-0000-000000000004"
LEVEL = "qos.nri-qos.io/level"


@dataclasses.dataclass
class Store:
    current: Config


async def until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        # Polling: the condition is a file the reconciler writes from its own thread.
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def watch(tmp_path: Path, server: FakeApiServer) -> tuple[Api, PodWatcher]:
    """The real client and pod watch of node-a against ``server``."""
    kube = KubernetesConfig(kubeconfig=str(write_kubeconfig(tmp_path / "kubeconfig",
                                                            server.url)),
                            request_timeout_s=5.0, retry_max_s=0.2)
    api = build_api_client(kube)
    assert api is not None
    return api, PodWatcher(api, kube, "node-a", initial_backoff_s=0.01)


async def test_annotation_change_through_the_api_is_applied_by_drift(tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host", version=2, driver="systemd")
    host.set_numa([(8 * GIB, 16 * GIB, 100)])
    pod = host.add_pod(UID, name="web-0", tier="burstable", memory_limit=1 * GIB)
    (container,) = pod.containers
    pid = container.pids[0]
    state = NodeState()
    state.replace_all(*host.nri())
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(host.root, audit)

    def oom() -> str:
        return (host.root / f"proc/{pid}/oom_score_adj").read_text().strip()

    def memory_high() -> str:
        return (host.cg("", container.rel) / "memory.high").read_text().strip()

    with FakeApiServer() as server:
        server.add_pod(make_pod("web-0", uid=UID, node="node-a",
                                memory={"c0": ("256Mi", "1Gi")}))
        async with reconciling(tmp_path, server, woken_by_the_watch_only(), state, sysfs, audit):
            # The API's view arrives: the request (256Mi) now comes from the pod spec.
            await until(lambda: state.snapshot().containers[0].info.memory_request == 256 << 20)
            # A burstable shared_cores pod: kubelet's values stand.
            assert (oom(), memory_high()) == ("0", "max")

            server.modify_pod("default", "web-0", annotate(LEVEL, "reclaimed_cores"))
            await until(lambda: oom() == "1000")
            await until(lambda: memory_high() == str(int(GIB * 0.95) // 4096 * 4096))
            reasons = {r["reason"] for r in sink.named("cgroup_write")}
            assert any("reclaimed_cores" in reason for reason in reasons)


async def test_a_reload_that_reads_another_annotation_reads_it_on_every_known_pod(
        tmp_path: Path) -> None:
    """The watch reports a pod again only when the API changes it: a reload that moves the
    level annotation to another key must trim the pods it knows anew, or they keep the old
    key's value and never show the new one."""
    host = FakeHost(tmp_path / "host", version=2, driver="systemd")
    host.set_numa([(8 * GIB, 16 * GIB, 100)])
    pod = host.add_pod(UID, name="web-0", tier="burstable", memory_limit=1 * GIB)
    pid = pod.containers[0].pids[0]
    base = Config()
    cfg = [dataclasses.replace(base, reconciler=dataclasses.replace(
        base.reconciler, drift_interval_s=3600.0))]
    state = NodeState(lambda: cfg[0].qos)
    state.replace_all(*host.nri())
    audit = AuditLog(MemoryAuditSink())
    sysfs = SysFs(host.root, audit)
    stop = asyncio.Event()
    subscribers: list[Callable[[], None]] = []

    def subscribe(call: Callable[[], None]) -> Callable[[], None]:
        subscribers.append(call)
        return lambda: subscribers.remove(call)

    def oom() -> str:
        return (host.root / f"proc/{pid}/oom_score_adj").read_text().strip()

    with FakeApiServer() as server:
        server.add_pod(make_pod("web-0", uid=UID, node="node-a",
                                annotations={"example.com/tier": "reclaimed_cores"},
                                memory={"c0": ("256Mi", "1Gi")}))
        api, watcher = watch(tmp_path, server)
        loops = build_loops(lambda: cfg[0], state, sysfs, probe_host(sysfs), None, audit)
        task = asyncio.create_task(run_reconciler(
            loops, state, stop, watcher, read_keys=lambda: cfg[0].read_keys(),
            backoff_max=lambda: 60, config_changes=subscribe))
        try:
            await until(lambda: state.snapshot().containers[0].info.memory_request == 256 << 20)
            assert oom() == "0"
            cfg[0] = dataclasses.replace(cfg[0], qos=dataclasses.replace(
                cfg[0].qos, annotation="example.com/tier"))
            for call in list(subscribers):
                call()  # the reload, as the config store calls its subscribers
            await until(lambda: oom() == "1000")
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            api.close()
        assert subscribers == []
