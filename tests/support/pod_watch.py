"""The reconciler run against a fake API server's pod watch, so that what an API change makes the
agent write can be waited for: a configuration on which only the watch wakes the loops, an
annotation change to hand :meth:`FakeApiServer.modify_pod`, and the running reconciler."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from common.audit import AuditLog
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.kube import PodWatcher
from reconciler.runner import build_loops, run_reconciler
from tests.support.fake_apiserver import FakeApiServer, api_client, client_config
from tests.support.fakesys import GIB, MIB, FakeContainer, FakeHost


def woken_by_the_watch_only() -> Config:
    """The defaults with hour-long loop periods: only the wake-ups from the pod watch can explain
    a prompt write."""
    base = Config()
    return dataclasses.replace(
        base,
        reconciler=dataclasses.replace(base.reconciler, drift_interval_s=3600.0,
                                       resctrl_interval_s=3600.0),
        memory_guard=dataclasses.replace(base.memory_guard, interval_s=3600.0),
        numa=dataclasses.replace(base.numa, interval_s=3600.0),
    )


def web_0(root: Path, uid: str) -> tuple[FakeHost, FakeContainer]:
    """A v2 fake host at ``root`` with one NUMA node and one pod, ``web-0`` (``uid``), burstable
    with a 512 MiB limit, and that pod's container."""
    host = FakeHost(root, version=2, driver="systemd")
    host.set_numa([(8 * GIB, 16 * GIB, 100)])
    pod = host.add_pod(uid, name="web-0", tier="burstable", memory_limit=512 * MIB)
    (container,) = pod.containers
    return host, container


def annotate(key: str, value: str | None) -> Callable[[dict[str, Any]], None]:
    """A change of a pod's annotation ``key`` to ``value``; None removes it."""
    def mutate(pod: dict[str, Any]) -> None:
        annotations = pod["metadata"]["annotations"]
        if value is None:
            annotations.pop(key, None)
        else:
            annotations[key] = value

    return mutate


@contextlib.asynccontextmanager
async def reconciling(tmp_path: Path, server: FakeApiServer, cfg: Config, state: NodeState,
                      sysfs: SysFs, audit: AuditLog) -> AsyncIterator[None]:
    """The reconciler with all its loops, fed by the real client's watch of node-a's pods on
    ``server``; stopped, and its client closed, on leaving."""
    stop = asyncio.Event()
    with api_client(kube := client_config(
            tmp_path, server, request_timeout_s=5.0, retry_max_s=0.2)) as api:
        watcher = PodWatcher(api, kube, "node-a", initial_backoff_s=0.01)
        loops = build_loops(lambda: cfg, state, sysfs, probe_host(sysfs), None, audit)
        task = asyncio.create_task(run_reconciler(loops, state, stop, watcher,
                                                  read_keys=cfg.read_keys,
                                                  backoff_max=lambda: 60))
        try:
            yield
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
