"""What Synchronize says of each container reaches the node state as the events would have: a
container the runtime lists as stopped (kubelet keeps the last exited instance of a restarted
container, and one may stop while the plugin is disconnected) is not taken for a running one, and
a container known from its CreateContainer keeps kubelet's request and score, which the runtime's
listing shows with this agent's adjustment in their place."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.events import Event
from nri_plugin.config.schema import Config
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.simulator import RuntimeSimulator
from protos import nri_api_pb2 as api
from tests.support.stub_runtime import container, pod


def _container(cid: str, state: int) -> api.Container:
    message = container(cid)
    message.state = state  # type: ignore[assignment]
    return message


def _tracking_plugin(executor: ThreadPoolExecutor) -> tuple[NodeState, PluginStub]:
    """The plugin's session keeping a node state of the containers, as the agent's does."""
    state = NodeState()
    return state, PluginStub(identity=PluginIdentity("nri-qos", "10"), config=Config,
                             capabilities=(), audit=AuditLog(MemoryAuditSink()),
                             executor=executor, state=state, track_containers=True)


async def _serve_once(simulator: RuntimeSimulator, stub: PluginStub, socket_path: Path,
                      count: int) -> asyncio.Task[str]:
    reader, writer = await asyncio.open_unix_connection(str(socket_path))
    serving = asyncio.create_task(stub.serve(reader, writer))
    await simulator.wait_ready(count=count)
    return serving


async def _close(stub: PluginStub, serving: asyncio.Task[str],
                 simulator: RuntimeSimulator) -> None:
    stub.close()
    await serving
    await simulator.stop()


async def test_a_container_listed_stopped_is_not_running(
        tmp_path: Path, executor: ThreadPoolExecutor) -> None:
    socket_path = tmp_path / "nri.sock"
    simulator = RuntimeSimulator(socket_path, pods=[pod()], containers=[
        _container("live", api.CONTAINER_RUNNING), _container("exited", api.CONTAINER_STOPPED)])
    await simulator.start()
    state, stub = _tracking_plugin(executor)
    serving = await _serve_once(simulator, stub, socket_path, 1)
    try:
        snapshot = state.snapshot()
        assert {c.info.id for c in snapshot.containers} == {"live", "exited"}
        assert [c.info.id for c in snapshot.running()] == ["live"]
    finally:
        await _close(stub, serving, simulator)


async def test_a_container_stopped_while_disconnected_is_not_running_after_reconnect(
        tmp_path: Path, executor: ThreadPoolExecutor) -> None:
    socket_path = tmp_path / "nri.sock"
    simulator = RuntimeSimulator(socket_path, pods=[pod()], containers=[
        _container("c1", api.CONTAINER_RUNNING)])
    await simulator.start()
    state, stub = _tracking_plugin(executor)
    serving = await _serve_once(simulator, stub, socket_path, 1)
    assert [c.info.id for c in state.snapshot().running()] == ["c1"]
    await simulator.stop()
    await serving

    # The container exited while nobody listened for its StopContainer.
    simulator.containers = [_container("c1", api.CONTAINER_STOPPED)]
    await simulator.start()
    serving = await _serve_once(simulator, stub, socket_path, 2)
    try:
        snapshot = state.snapshot()
        assert [c.info.id for c in snapshot.containers] == ["c1"]
        assert snapshot.running() == ()
    finally:
        await _close(stub, serving, simulator)


def _kubelets_container(min_bytes: int, score: int) -> api.Container:
    message = _container("c1", api.CONTAINER_RUNNING)
    message.linux.resources.unified["memory.min"] = str(min_bytes)
    message.linux.oom_score_adj.value = score
    return message


async def test_a_reconnect_keeps_kubelets_request_and_score_of_a_known_container(
        tmp_path: Path, executor: ThreadPoolExecutor) -> None:
    socket_path = tmp_path / "nri.sock"
    simulator = RuntimeSimulator(socket_path, pods=[pod()])
    await simulator.start()
    state, stub = _tracking_plugin(executor)
    serving = await _serve_once(simulator, stub, socket_path, 1)
    # Created with kubelet's MemoryQoS request (memory.min) and its score.
    await simulator.send(simulator.connections[-1], Event.CREATE_CONTAINER, pod(),
                         _kubelets_container(1 << 30, 900))
    known = state.container("c1")
    assert known is not None
    assert (known.memory_request, known.oom_score_adj) == (1 << 30, 900)
    await simulator.stop()
    await serving

    # The runtime lists the container as it runs: with the values this agent's answer set.
    simulator.containers = [_kubelets_container(1 << 29, 1000)]
    await simulator.start()
    serving = await _serve_once(simulator, stub, socket_path, 2)
    try:
        listed = state.container("c1")
        assert listed is not None
        assert (listed.memory_request, listed.oom_score_adj) == (1 << 30, 900)
    finally:
        await _close(stub, serving, simulator)
