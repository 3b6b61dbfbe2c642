"""Load, bounded: what the agent keeps after many pods came and went, and after a Synchronize of
thousands of containers. Correctness only; the figures (throughput, latency, memory) come from
``bench/load.py``.

Whether anything of a pod is still held is asked of the garbage collector: every string naming
one of a test's pods (uid, sandbox and container ids, cgroup paths, group names) carries a marker
made at run time, and no object may still refer to such a string once the pods are gone. That
covers the node state and every per-pod cache of every component, including ones nobody thought
to list.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import uuid
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from common.aio import Backoff
from common.audit import AuditLog
from common.state import NodeState
from hooks.events import Event
from nri_plugin.agent import Agent, build_agent, probe, run_agent
from nri_plugin.config.schema import Config
from nri_plugin.config.store import ConfigStore
from nri_plugin.connection import run_external
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.scenario import RuntimeSpec
from nri_plugin.sim.simulator import PluginConnection, RuntimeSimulator
from protos import nri_api_pb2 as api
from tests.support.fakesys import GIB, FakeHost, nri_messages

LEVEL = "qos.nri-qos.io/level"
POD_GROUP = {"node.koordinator.sh/resctrl":
             '{"LLC":{"schemata":{"range":[20,80]}},"MB":{"schemata":{"percent":20}}}'}
BOUND_S = 15.0


def marker() -> str:
    """A string found in no constant of the code: only the test's own pods carry it."""
    return uuid.uuid4().hex[:8]


def holders(mark: str) -> list[str]:
    """What still refers to a string carrying ``mark`` (a type and the string, the marker
    blanked so that the answer does not hold one itself)."""
    gc.collect()
    found: list[str] = []
    for obj in gc.get_objects():
        for ref in gc.get_referents(obj):
            if type(ref) is str and mark in ref and ref != mark:
                found.append(f"{type(obj).__qualname__}: {ref.replace(mark, '*')[:120]}")
                break
    return found


async def until_released(mark: str) -> None:
    """Wait (bounded) until nothing refers to the marked pods any more; fail naming what does."""
    left: list[str] = []
    for _ in range(int(BOUND_S / 0.25)):
        left = holders(mark)
        if not left:
            return
        await asyncio.sleep(0.25)  # the loops' next cycles drop what they cached
    pytest.fail(f"{len(left)} object(s) still hold removed pods: {left[:10]}")


def uid_of(mark: str, n: int) -> str:
    return f"{mark}-{n:04x}-4000-8000-{n:012x}"


def agent_config(root: Path, tmp_path: Path) -> str:
    return f"""
[reconciler]
root = "{root}"
state_dir = "{tmp_path / 'state'}"
resctrl_interval_s = 0.05
drift_interval_s = 0.1
gc_grace_s = 0
full_scan_every = 2
[memory_guard]
interval_s = 0.1
[numa]
interval_s = 0.1
[detection]
interval_s = 0.1
[eviction]
interval_s = 0.1
plugin_dir = "{tmp_path / 'eviction-plugins'}"
[kubernetes]
enabled = false
[metrics]
enabled = false
[status]
enabled = false
[plugin]
reconnect_initial_ms = 20
"""


@dataclass
class Running:
    agent: Agent
    simulator: RuntimeSimulator
    connection: PluginConnection
    host: FakeHost


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    """The whole agent (NRI stub, reconciler, detection, ladder, eviction manager) on a fake
    host, connected to the runtime simulator."""
    root = tmp_path / "host"
    host = FakeHost(root)
    host.make_resctrl()
    host.set_numa([(24 * GIB, 32 * GIB, 1000)])
    config_path = tmp_path / "config.toml"
    config_path.write_text(agent_config(root, tmp_path))

    def discard(event: str, fields: Mapping[str, Any]) -> None:
        """The audit trail goes to the log in production: it is not the agent's memory."""

    audit = AuditLog(discard)
    store = ConfigStore(audit)
    store.load_initial(config_path)
    host_info, sysfs = probe(store.current, audit)
    agent = build_agent(store, audit, host_info, sysfs, PluginIdentity("nri-qos", "10"),
                        run_background=True)
    socket_path = tmp_path / "nri.sock"
    simulator = RuntimeSimulator(socket_path)
    await simulator.start()
    stop = asyncio.Event()
    connection = functools.partial(run_external, socket_path=str(socket_path),
                                   backoff=Backoff(0.02, 0.1))
    task = asyncio.create_task(run_agent(agent, connection, stop))
    try:
        yield Running(agent, simulator, await simulator.wait_ready(), host)
    finally:
        stop.set()
        assert await task == 0
        await simulator.stop()



async def churn(run: Running, mark: str, pods: int, in_flight: int) -> None:
    """Create and remove ``pods`` pods through their whole lifecycle, ``in_flight`` at a time;
    every fourth asks for a resctrl group of its own, every other one is reclaimed, every tenth
    container has a cgroups path the loops cannot use."""
    numbers = iter(range(pods))

    async def worker() -> None:
        sim, conn = run.simulator, run.connection
        for n in numbers:
            annotations = {LEVEL: "reclaimed_cores" if n % 2 else "shared_cores"}
            if n % 4 == 0:
                annotations.update(POD_GROUP)
            fake = run.host.add_pod(uid_of(mark, n), name=f"p{n}", tier="besteffort"
                                    if n % 2 else "burstable", annotations=annotations)
            pod, (ctr,) = nri_messages(fake, state=api.CONTAINER_UNKNOWN, memory_limit=GIB)
            if n % 10 == 5:
                ctr.linux.cgroups_path = f"{mark}-{n}:not-a-cgroups-path"
            await sim.send(conn, Event.RUN_POD_SANDBOX, pod)
            await sim.send(conn, Event.CREATE_CONTAINER, pod, ctr)
            ctr.state = api.CONTAINER_RUNNING
            await sim.send(conn, Event.START_CONTAINER, pod, ctr)
            await asyncio.sleep(0.001)  # let the loops see it running
            ctr.state = api.CONTAINER_STOPPED
            await sim.send(conn, Event.STOP_CONTAINER, pod, ctr)
            await sim.send(conn, Event.REMOVE_CONTAINER, pod, ctr)
            await sim.send(conn, Event.STOP_POD_SANDBOX, pod)
            await sim.send(conn, Event.REMOVE_POD_SANDBOX, pod)
            run.host.remove_pod(fake)

    await asyncio.gather(*(worker() for _ in range(in_flight)))


async def test_pods_created_and_removed_leave_nothing_behind(running: Running) -> None:
    mark = marker()
    await churn(running, mark, pods=128, in_flight=16)
    # The simulator's own record of the answers is the runtime's memory, not the agent's.
    running.connection.answers.clear()
    assert running.agent.state.snapshot().pods == {}
    await until_released(mark)
    # The pod groups went with their pods; the class groups stay.
    resctrl = running.host.root / "sys/fs/resctrl"
    assert sorted(p.name for p in resctrl.iterdir() if p.is_dir() and "pod" in p.name) == []
    assert running.connection.alive


def sync_lists(mark: str, first: int, pods: int,
               per_pod: int) -> tuple[list[api.PodSandbox], list[api.Container]]:
    pod_msgs, containers = [], []
    for n in range(first, first + pods):
        uid = uid_of(mark, n)
        pod = api.PodSandbox(id=f"sb-{uid}", uid=uid, name=f"p{n}", namespace="load")
        pod.linux.cgroup_parent = f"/kubepods/burstable/pod{uid}"
        pod_msgs.append(pod)
        for c in range(per_pod):
            ctr = api.Container(id=f"{uid}-{c}", pod_sandbox_id=pod.id, name=f"c{c}",
                                state=api.CONTAINER_RUNNING)
            ctr.linux.cgroups_path = f"/kubepods/burstable/pod{uid}/{uid}-{c}"
            containers.append(ctr)
    return pod_msgs, containers


async def synchronized(socket_path: Path, stub: PluginStub,
                       lists: tuple[list[api.PodSandbox], list[api.Container]],
                       chunk: int) -> tuple[RuntimeSimulator, PluginConnection,
                                            asyncio.Task[str]]:
    # The whole Synchronize shares one request timeout on the runtime's side: a generous one,
    # since correctness is asked here, not speed.
    simulator = RuntimeSimulator(socket_path, RuntimeSpec(sync_chunk=chunk,
                                                          request_timeout_ms=30_000),
                                 pods=lists[0], containers=lists[1])
    await simulator.start()
    reader, writer = await asyncio.open_unix_connection(str(socket_path))
    serving = asyncio.create_task(stub.serve(reader, writer))
    return simulator, await simulator.wait_ready(timeout_s=30), serving


async def test_a_synchronize_of_thousands_of_containers_in_chunks_yields_the_full_state(
    tmp_path: Path, executor: ThreadPoolExecutor,
) -> None:
    kept, dropped = marker(), marker()
    state = NodeState()
    cfg = Config()
    stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: cfg,
                      capabilities=[], audit=AuditLog(lambda event, fields: None),
                      executor=executor, state=state, track_containers=True)
    staying = sync_lists(kept, 0, 625, 4)
    leaving = sync_lists(dropped, 625, 625, 4)
    both = (staying[0] + leaving[0], staying[1] + leaving[1])
    socket_path = tmp_path / "nri.sock"
    simulator, connection, serving = await synchronized(socket_path, stub, both, 500)
    try:
        # 1,250 pods and 5,000 containers in ten chunks, every one answered "more" but the last.
        assert [r.more for r in connection.sync_responses] == [True] * 9 + [False]
        snapshot = state.snapshot()
        assert set(snapshot.pods) == {p.id for p in both[0]}
        assert len(snapshot.running()) == 5000
        assert {(c.info.id, c.info.cgroups_path) for c in snapshot.containers} == {
            (c.id, c.linux.cgroups_path) for c in both[1]}
    finally:
        stub.close()
        await serving
        await simulator.stop()
    del snapshot, both, leaving

    # After a reconnect the runtime lists half of them: the other half is forgotten, wholly.
    simulator, connection, serving = await synchronized(socket_path, stub, staying, 500)
    try:
        assert len(connection.sync_responses) == 5
        snapshot = state.snapshot()
        assert set(snapshot.pods) == {p.id for p in staying[0]}
        assert len(snapshot.running()) == 2500
        del snapshot
        await until_released(dropped)
        assert holders(kept)  # (the marker works: what stays is found)
    finally:
        stub.close()
        await serving
        await simulator.stop()

