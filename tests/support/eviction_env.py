"""The eviction manager on a fake host tree, with in-tree plugins the test scripts, an injected
clock and, when given a fake API server, the real kubernetes client."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.aio import Callbacks
from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import pod_meta_from_object
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.eviction.api import (
    ActivePod,
    EvictPods,
    EvictRequest,
    MetType,
    ThresholdMet,
    TopPods,
)
from reconciler.eviction.config import EvictionConfig
from reconciler.eviction.manager import EvictionManager
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.kube import KubeActions, KubernetesConfig, build_api_client
from reconciler.metrics import ReconcilerMetrics
from tests.support.fake_apiserver import FakeApiServer, make_pod, write_kubeconfig
from tests.support.fakesys import FakeHost, FakePod

GIB = 1 << 30
NODE = "node-a"
LEVEL = "qos.nri-qos.io/level"


@dataclass
class Scripted:
    """An in-tree plugin whose answers the test sets; ``hang`` and ``fail`` break it."""

    name: str
    threshold: ThresholdMet = field(default_factory=lambda: ThresholdMet(MetType.NOT_MET))
    evict: EvictPods = field(default_factory=EvictPods)
    top: TopPods = field(default_factory=lambda: TopPods(()))
    hang: bool = False
    fail: bool = False
    calls: list[tuple[str, Any]] = field(default_factory=list)

    async def _trouble(self) -> None:
        if self.hang:
            await asyncio.sleep(30)
        if self.fail:
            raise RuntimeError("plugin bug")

    async def threshold_met(self) -> ThresholdMet:
        self.calls.append(("ThresholdMet", None))
        await self._trouble()
        return self.threshold

    async def get_top_eviction_pods(self, active: Sequence[ActivePod], top_n: int,
                                    scope: str) -> TopPods:
        self.calls.append(("GetTopEvictionPods", (list(active), top_n, scope)))
        await self._trouble()
        return self.top

    async def get_evict_pods(self, active: Sequence[ActivePod]) -> EvictPods:
        self.calls.append(("GetEvictPods", list(active)))
        await self._trouble()
        return self.evict

    def called(self, call: str) -> list[Any]:
        return [args for name, args in self.calls if name == call]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Env:
    host: FakeHost
    state: NodeState
    sink: MemoryAuditSink
    clock: Clock
    system: Scripted
    rss: Scripted
    manager: EvictionManager
    cfg: list[Config]
    metrics: ReconcilerMetrics
    # What the manager hears of changes to the detectors' levels (``changed.call()``).
    changed: Callbacks
    pods: dict[str, FakePod] = field(default_factory=dict)

    def configure(self, **changes: Any) -> None:
        self.cfg[0] = dataclasses.replace(
            self.cfg[0], eviction=dataclasses.replace(self.cfg[0].eviction, **changes))

    def add_pod(self, name: str, *, level: str = "reclaimed_cores", anon: int = GIB,
                priority: int | None = 0, owner: str | None = "ReplicaSet",
                namespace: str = "batch", fake: FakeApiServer | None = None,
                nri_annotations: dict[str, str] | None = None, **meta: Any) -> FakePod:
        """``nri_annotations``: more annotations on the runtime's copy (kubelet's)."""
        uid = f"{name:0<8}-0000-0000-0000-000000000000"[:36]
        pod = self.host.add_pod(uid, tier="besteffort" if level == "reclaimed_cores"
                                else "burstable", name=name, namespace=namespace,
                                annotations={LEVEL: level, **(nri_annotations or {})},
                                memory_request=GIB)
        self.host.set_pod_anon(pod, anon)
        obj = make_pod(name, namespace=namespace, uid=uid, priority=priority, owner_kind=owner,
                       annotations={LEVEL: level}, memory={"c0": ("1Gi", None)})
        obj["metadata"].update(meta)
        if fake is not None:
            fake.add_pod(obj)
        self.state.replace_all(*self.host.nri())
        self.state.apply_meta(pod_meta_from_object(obj))
        self.pods[name] = pod
        return pod

    def uid(self, name: str) -> str:
        return self.pods[name].info.uid

    async def round(self) -> list[tuple[str, str]]:
        report = await self.manager.run_round()
        return [(d.pod, d.outcome.value) for d in report.decisions]

    def audited(self, event: str, key: str = "pod") -> list[Any]:
        return [r[key] for r in self.sink.named(event)]


def make_env(tmp_path: Path, fake: FakeApiServer | None, *, request_timeout_s: float = 2.0,
             notes: StateFile | None = None, **changes: Any) -> Env:
    """``changes``: to the ``[eviction]`` section; ``notes``: the agent's state file."""
    host = FakeHost(tmp_path / "host")
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    state = NodeState()
    base = EvictionConfig(plugin_dir=str(tmp_path / "plugins"), dry_run=False,
                          retry_initial_s=5.0, retry_max_s=20.0)
    cfg = [dataclasses.replace(Config(), eviction=dataclasses.replace(base, **changes))]
    api = None
    kube = KubernetesConfig(request_timeout_s=request_timeout_s)
    if fake is not None:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url)
        kube = KubernetesConfig(kubeconfig=str(kubeconfig), request_timeout_s=request_timeout_s)
        api = build_api_client(kube)
    clock = Clock()
    metrics = ReconcilerMetrics()
    system, rss = Scripted("system_pressure"), Scripted("rss_overuse")
    changed = Callbacks()
    manager = EvictionManager(
        lambda: cfg[0], state, KubeActions(api, kube, audit), NODE, audit,
        SysFs(host.root), CgroupLayout(1, "cgroupfs"),
        {"system_pressure": system, "rss_overuse": rss}, clock=clock, metrics=metrics,
        changes=changed.subscribe, notes=notes)
    return Env(host, state, sink, clock, system, rss, manager, cfg, metrics, changed)


def forced(env: Env, *names: str, plugin: Scripted | None = None, force: bool = True) -> None:
    target = plugin or env.system
    target.evict = EvictPods(tuple(EvictRequest(env.uid(n), f"{n} must go", None, force)
                                   for n in names))
