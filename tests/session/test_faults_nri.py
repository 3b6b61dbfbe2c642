"""Faults on the runtime's side of the NRI connection, each with the outcome the agent promises.

The runtime goes away in the middle of a request, restarts while pods are being created, never
answers RegisterPlugin, configures the plugin before that answer, or waits on a capability that
hangs; the plugin itself restarts on a node whose resctrl groups it made before. Every case runs
over a real unix socket against the stub (or ``run_external``, the daemon's connection loop);
waits are bounded by the deadline they check.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from common.aio import Backoff
from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.events import Event
from hooks.settings import ContainerSettings
from nri_plugin.agent import Agent, build_agent, probe
from nri_plugin.config.schema import Config
from nri_plugin.config.store import ConfigStore
from nri_plugin.connection import run_external
from nri_plugin.session.capability import Capability, ContainerEvent, PodEvent
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.scenario import RuntimeSpec
from nri_plugin.sim.simulator import RuntimeSimulator
from nri_plugin.wire.envelope import decode_request, encode_response
from nri_plugin.wire.errors import ConnectionClosed
from nri_plugin.wire.mux import RUNTIME_SERVICE_CONN, encode_message
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.ttrpc import MessageType, encode_frame
from protos import nri_api_pb2 as api
from reconciler.host.resctrlfs import ResctrlFs
from reconciler.loops.base import Loop
from reconciler.runner import build_loops
from tests.support.fakesys import FakeHost, nri_messages
from tests.support.raw_runtime import (
    BOUND_S,
    Session,
    configure_request,
    container_message,
    create_request,
    plugin_config,
    pod_message,
    socket_pair,
)

SHORT_MS = 100
"""Registration timeout of the tests' runtimes and plugins: the deadline of a handshake step."""


class Hanging(Capability):
    """A capability that blocks in its worker thread until released (as one stuck on a kernel
    file would), at RunPodSandbox and CreateContainer; ``entered`` is set once it blocks."""

    name = "hanging"
    events = frozenset({Event.RUN_POD_SANDBOX, Event.CREATE_CONTAINER})

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    def _hang(self) -> None:
        self.entered.set()
        self.release.wait(10)
        self.returned.set()

    def run_pod_sandbox(self, event: PodEvent) -> None:
        self._hang()

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        self._hang()
        return ContainerSettings(annotations={"hanging": "late"})


class Quick(Capability):
    """Answers CreateContainer at once with one annotation."""

    name = "quick"
    events = frozenset({Event.CREATE_CONTAINER})

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        return ContainerSettings(annotations={"quick": "yes"})


Start = Callable[..., Any]


@pytest.fixture
async def session(executor: ThreadPoolExecutor) -> AsyncIterator[Start]:
    """A stub serving one end of a socket pair; the test plays the runtime at the other. Each
    call is a new connection of the same stub (as after a reconnect)."""
    made: list[Session] = []
    stubs: dict[int, tuple[PluginStub, MemoryAuditSink, NodeState]] = {}

    async def start(capabilities: Sequence[Capability] = (), cfg: Config | None = None, *,
                    stub: PluginStub | None = None) -> Session:
        if stub is None:
            current = cfg or plugin_config()
            sink, state = MemoryAuditSink(), NodeState()
            stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: current,
                              capabilities=capabilities, audit=AuditLog(sink),
                              executor=executor, state=state)
            stubs[id(stub)] = (stub, sink, state)
        stub, sink, state = stubs[id(stub)]
        reader, writer, runtime = await socket_pair()
        made.append(Session(stub, runtime, asyncio.create_task(stub.serve(reader, writer)),
                            sink, state))
        return made[-1]

    yield start
    for stub, _, _ in stubs.values():
        stub.close()
    for made_session in made:
        made_session.runtime.close()
        await made_session.serving


# -- the runtime goes away in the middle of a request ---------------------------------------------


async def test_a_runtime_gone_mid_request_ends_the_session_and_the_late_answer_is_dropped(
    session: Start,
) -> None:
    capability = Hanging()
    setup = await session([capability])
    await setup.runtime.handshake()
    pod = pod_message("mid")
    setup.runtime.send("RunPodSandbox", api.RunPodSandboxRequest(pod=pod).SerializeToString())
    assert await asyncio.to_thread(capability.entered.wait, BOUND_S)
    setup.runtime.close()  # containerd dies while the plugin works on its request
    assert await setup.ended() == "connection closed by peer"
    assert not setup.stub.connected
    assert setup.stub.connection_state == "disconnected"
    # The capability's work ends later, in its thread; its result goes nowhere (no task waits for
    # it, nothing is raised: the conftest guard fails a test that leaves a task behind).
    capability.release.set()
    assert await asyncio.to_thread(capability.returned.wait, BOUND_S)
    # The pod was taken into the node state as the request arrived; the next Synchronize (after
    # the reconnect) decides whether it is still there.
    assert set(setup.state.snapshot().pods) == {"sb-mid"}

    again = await session(stub=setup.stub)
    await again.runtime.register()
    await again.runtime.call("Configure", configure_request())
    await again.runtime.call("Synchronize", b"")
    assert setup.state.snapshot().pods == {}
    assert await again.runtime.create_container_ok("after")


async def test_a_runtime_gone_halfway_through_a_frame_ends_the_session(session: Start) -> None:
    setup = await session()
    await setup.runtime.handshake()
    whole = setup.runtime.request_bytes("CreateContainer", create_request("half"),
                                        setup.runtime.stream())
    setup.runtime.write(whole[: len(whole) // 2])
    await setup.runtime.flush()
    setup.runtime.close()
    assert await setup.ended() == "connection closed by peer"
    # Nothing of the half request was served.
    assert setup.state.snapshot().pods == {}


async def test_an_update_in_flight_when_the_runtime_goes_fails_with_connection_closed(
    session: Start,
) -> None:
    setup = await session()
    await setup.runtime.handshake()
    update = asyncio.create_task(setup.stub.update_containers(
        [api.ContainerUpdate(container_id="c1")], timeout_s=BOUND_S))
    # The runtime reads the call, then dies without answering it.
    conn, frame = await setup.runtime.frame()
    assert (conn, decode_request(frame.data).method) == (RUNTIME_SERVICE_CONN, "UpdateContainers")
    setup.runtime.close()
    with pytest.raises(ConnectionClosed, match="connection closed by peer"):
        async with asyncio.timeout(BOUND_S):
            await update
    await setup.ended()


# -- RegisterPlugin never answered, or answered after Configure ----------------------------------


async def test_a_runtime_that_never_answers_register_plugin_is_left(session: Start) -> None:
    setup = await session(cfg=plugin_config(register_timeout_ms=SHORT_MS))
    _conn, frame = await setup.runtime.frame()
    assert decode_request(frame.data).method == "RegisterPlugin"
    # ... and nothing more: not an answer, not a Configure.
    reason = await setup.ended()
    assert reason.startswith("registration failed with code 4"), reason
    assert setup.stub.rejections.as_dict()["handshake_timeout"] == 0
    assert await setup.runtime.closed_within(BOUND_S)


async def test_a_configured_session_whose_registration_is_never_answered_is_left(
    session: Start,
) -> None:
    # Configure and Synchronize come, but the answer to RegisterPlugin never does: the runtime
    # is not following its own protocol, and the plugin cannot know it is registered. It serves
    # meanwhile, then leaves at its registration timeout (and connects again).
    setup = await session(cfg=plugin_config(register_timeout_ms=SHORT_MS))
    await setup.runtime.frame()  # RegisterPlugin, kept unanswered
    assert (await setup.runtime.call("Configure", configure_request())).ok
    assert (await setup.runtime.call("Synchronize", b"")).ok
    assert await setup.runtime.create_container_ok()
    assert (await setup.ended()).startswith("registration failed with code 4")


async def test_configure_before_the_register_plugin_answer_is_served(session: Start) -> None:
    capability = Quick()
    setup = await session([capability], cfg=plugin_config(register_timeout_ms=SHORT_MS))
    runtime = setup.runtime
    conn, frame = await runtime.frame()
    assert (conn, decode_request(frame.data).method) == (RUNTIME_SERVICE_CONN, "RegisterPlugin")
    # As containerd may: Configure and Synchronize on their way before the RegisterPlugin answer.
    configure = await runtime.call("Configure", configure_request(SHORT_MS))
    assert configure.ok
    assert api.ConfigureResponse.FromString(configure.payload).events != 0
    assert (await runtime.call("Synchronize", b"")).ok
    runtime.write(encode_message(RUNTIME_SERVICE_CONN, encode_frame(
        frame.stream_id, MessageType.RESPONSE, encode_response())))
    await runtime.flush()
    # Registered and synchronized: no handshake step is owed, so no deadline ends the session
    # (waiting three registration timeouts proves it).
    await asyncio.sleep(3 * SHORT_MS / 1000)
    assert setup.stub.connected
    reply = await runtime.call("CreateContainer", create_request("early"))
    assert reply.ok
    answer = api.CreateContainerResponse.FromString(reply.payload)
    assert dict(answer.adjust.annotations) == {"quick": "yes"}
    assert setup.stub.rejections.as_dict()["handshake_timeout"] == 0
    assert setup.stub.connection_state == "synchronized"


# -- a capability that hangs ----------------------------------------------------------------------


async def test_hung_capabilities_in_every_worker_still_answer_before_the_runtime_times_out(
    tmp_path: Path, executor: ThreadPoolExecutor,
) -> None:
    # The configured deadline (2 s) is longer than the runtime's request timeout: the stub keeps
    # its own below the runtime's, and a capability that never returns costs only its own part.
    # The simulated runtime drops a plugin that answers late, as containerd does.
    capabilities = [Hanging(), Quick()]
    runtime_timeout_ms = 400
    cfg = plugin_config(deadline_ms=2000)
    margin = cfg.plugin.deadline_margin_ms
    simulator = RuntimeSimulator(tmp_path / "nri.sock",
                                 RuntimeSpec(request_timeout_ms=runtime_timeout_ms))
    await simulator.start()
    sink = MemoryAuditSink()
    stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: cfg,
                      capabilities=capabilities, audit=AuditLog(sink), executor=executor,
                      state=NodeState())
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "nri.sock"))
    serving = asyncio.create_task(stub.serve(reader, writer))
    try:
        connection = await simulator.wait_ready()
        assert stub.deadline_ms() == runtime_timeout_ms - margin
        # More requests than worker threads: each one after the fourth finds every worker hung.
        for i in range(6):
            response = await simulator.send(connection, Event.CREATE_CONTAINER,
                                            pod_message(f"h{i}"), container_message(f"h{i}"))
            assert isinstance(response, api.CreateContainerResponse)
            # Fail-open: the hung capability's part is missing; the answer came in time.
            assert dict(response.adjust.annotations) == {}
            assert connection.alive
        skipped = sink.named("adjustment_skipped")
        assert len(skipped) == 6
        assert all("deadline" in r["reason"] and "hanging" in r["reason"] for r in skipped)
    finally:
        capabilities[0].release.set()  # type: ignore[attr-defined]
        stub.close()
        await serving
        await simulator.stop()


async def test_a_capability_that_hangs_in_strict_mode_answers_an_error_in_time(
    session: Start,
) -> None:
    capability = Hanging()
    setup = await session([capability], cfg=plugin_config(strict=True, deadline_ms=100))
    await setup.runtime.handshake()
    try:
        reply = await setup.runtime.call("CreateContainer", create_request("strict"),
                                         seconds=1.0)
        assert reply.code == StatusCode.DEADLINE_EXCEEDED
        assert "hanging" in reply.message
        assert setup.stub.connected
    finally:
        capability.release.set()


# -- containerd restarts while pods are being created ---------------------------------------------


def lifecycle_pod(name: str) -> tuple[api.PodSandbox, api.Container]:
    pod, ctr = pod_message(name), container_message(name)
    ctr.state = api.CONTAINER_RUNNING
    return pod, ctr


async def test_a_runtime_restart_while_pods_are_created_resynchronizes_once(
    tmp_path: Path, executor: ThreadPoolExecutor,
) -> None:
    socket_path = tmp_path / "nri.sock"
    state = NodeState()
    cfg = plugin_config(reconnect_initial_ms=20, reconnect_max_ms=100)
    stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: cfg,
                      capabilities=[Quick()], audit=AuditLog(MemoryAuditSink()),
                      executor=executor, state=state, track_containers=True)
    simulator = RuntimeSimulator(socket_path)
    await simulator.start()
    stop = asyncio.Event()
    daemon = asyncio.create_task(run_external(stub, stop, socket_path=str(socket_path),
                                              backoff=Backoff(0.02, 0.1)))
    try:
        first = await simulator.wait_ready()
        done: list[tuple[api.PodSandbox, api.Container]] = []
        interrupted: list[str] = []

        async def create_pods(worker: int) -> None:
            # One pod after another, each through RunPodSandbox, CreateContainer and
            # StartContainer, until the runtime goes away under the worker.
            for i in range(1000):
                pod, ctr = lifecycle_pod(f"w{worker}-{i}")
                try:
                    await simulator.send(first, Event.RUN_POD_SANDBOX, pod)
                    await simulator.send(first, Event.CREATE_CONTAINER, pod, ctr)
                    await simulator.send(first, Event.START_CONTAINER, pod, ctr)
                except ConnectionClosed:
                    interrupted.append(pod.uid)
                    return
                done.append((pod, ctr))

        workers = [asyncio.create_task(create_pods(w)) for w in range(8)]
        async with asyncio.timeout(10):
            while len(done) < 40:  # noqa: ASYNC110 (the workers' progress is the condition)
                await asyncio.sleep(0.005)
        await simulator.stop()  # containerd restarts with requests in flight
        await asyncio.gather(*workers)
        assert len(interrupted) == 8
        # Taken in as they arrived: the pods of the interrupted creations are known too.
        assert len(state.snapshot().pods) >= len(done)

        # The restarted runtime knows the pods that got through, less one removed while the
        # plugin was away, plus two created meanwhile; containers of interrupted creations
        # never came to be.
        survivors = done[1:]
        created_meanwhile = [lifecycle_pod(f"new-{i}") for i in range(2)]
        listed = survivors + created_meanwhile
        simulator.pods = [pod for pod, _ in listed]
        simulator.containers = [ctr for _, ctr in listed]
        simulator.runtime = RuntimeSpec(sync_chunk=16)  # and it lists them in chunks
        await simulator.start()
        second = await simulator.wait_ready(count=2)
        # One registration live at a time: the old connection was closed before the new one
        # registered, and exactly two connections were ever made.
        assert len(simulator.connections) == 2
        assert simulator.live() == [second]
        assert not first.alive
        assert stub.connections == 2
        assert [r.more for r in second.sync_responses][-1] is False
        snapshot = state.snapshot()
        assert set(snapshot.pods) == {pod.id for pod, _ in listed}
        assert {c.info.id for c in snapshot.running()} == {ctr.id for _, ctr in listed}
        # Events flow again on the new connection.
        pod, ctr = lifecycle_pod("after")
        response = await simulator.send(second, Event.CREATE_CONTAINER, pod, ctr)
        assert isinstance(response, api.CreateContainerResponse)
        assert dict(response.adjust.annotations) == {"quick": "yes"}
    finally:
        stop.set()
        assert await daemon
        await simulator.stop()


# -- the plugin restarts --------------------------------------------------------------------------

LEVEL = "qos.nri-qos.io/level"
POD_GROUP = {"node.koordinator.sh/resctrl":
             '{"LLC":{"schemata":{"range":[20,80]}},"MB":{"schemata":{"percent":20}}}'}


def restart_config(root: Path) -> str:
    return (f'[agent]\nmode = "enforce"\n[reconciler]\nroot = "{root}"\ngc_grace_s = 0\n'
            "[kubernetes]\nenabled = false\n[status]\nenabled = false\n"
            "[metrics]\nenabled = false\n")


@dataclass
class Instance:
    """One run of the agent on the node: built from scratch, as after a restart."""

    agent: Agent
    sink: MemoryAuditSink
    loops: list[Loop]
    serving: asyncio.Task[str] | None = None

    def cycle(self, now: float) -> None:
        for loop in self.loops:
            loop.cycle(now)

    def named(self, event: str) -> list[dict[str, Any]]:
        return self.sink.named(event)


def start_instance(config_path: Path) -> Instance:
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    store = ConfigStore(audit)
    store.load_initial(config_path)
    host, sysfs = probe(store.current, audit)
    agent = build_agent(store, audit, host, sysfs, PluginIdentity("nri-qos", "10"),
                        run_background=False)
    cfg = store.current
    assert host.resctrl is not None
    resctrl = ResctrlFs(sysfs, cfg.resctrl.root, host.resctrl, prefix=cfg.resctrl.group_prefix,
                        audit=audit)
    loops = build_loops(lambda: store.current, agent.state, sysfs, host, resctrl, audit)
    return Instance(agent, sink, loops)


async def connect(instance: Instance, socket_path: Path) -> None:
    reader, writer = await asyncio.open_unix_connection(str(socket_path))
    instance.serving = asyncio.create_task(instance.agent.stub.serve(reader, writer))


async def stop_instance(instance: Instance) -> None:
    instance.agent.stub.close()
    if instance.serving is not None:
        await instance.serving
    instance.agent.executor.shutdown(wait=False, cancel_futures=True)



async def test_a_restarted_plugin_rebuilds_its_state_without_leaks_or_repeated_writes(
    tmp_path: Path,
) -> None:
    root = tmp_path / "host"
    host = FakeHost(root)
    resctrl = host.make_resctrl()
    own_group = host.add_pod(uid_of(1), tier="burstable",
                             annotations={LEVEL: "shared_cores", **POD_GROUP})
    removed_meanwhile = host.add_pod(uid_of(2), tier="burstable",
                                     annotations={LEVEL: "shared_cores", **POD_GROUP})
    reclaimed = host.add_pod(uid_of(3), tier="besteffort")
    config_path = tmp_path / "config.toml"
    config_path.write_text(restart_config(root))
    socket_path = tmp_path / "nri.sock"

    # The first run sees every pod created, puts tasks in place and repairs the processes.
    first = start_instance(config_path)
    simulator = RuntimeSimulator(socket_path)
    await simulator.start()
    try:
        await connect(first, socket_path)
        connection = await simulator.wait_ready()
        for pod in (own_group, removed_meanwhile, reclaimed):
            pod_msg, containers = nri_messages(pod)
            await simulator.send(connection, Event.RUN_POD_SANDBOX, pod_msg)
            for ctr in containers:
                await simulator.send(connection, Event.CREATE_CONTAINER, pod_msg, ctr)
                await simulator.send(connection, Event.START_CONTAINER, pod_msg, ctr)
        first.cycle(0.0)
        first.cycle(1.0)
    finally:
        await stop_instance(first)
        await simulator.stop()
    groups_before = sorted(p.name for p in resctrl.iterdir() if p.is_dir())
    assert f"nriqos-pod-{own_group.info.uid}" in groups_before
    assert len(first.named("resctrl_group_created")) == 4 + 2  # class groups, two pod groups
    assert first.named("cgroup_write")  # the reclaimed pod's oom_score_adj

    # While the plugin is down the runtime removes one pod and starts two: one asking for a
    # group of its own, one reclaimed.
    host.remove_pod(removed_meanwhile)
    missed_group = host.add_pod(uid_of(4), tier="burstable",
                                annotations={LEVEL: "shared_cores", **POD_GROUP})
    missed = host.add_pod(uid_of(5), tier="besteffort")

    second = start_instance(config_path)
    views = [nri_messages(p) for p in host.pods]
    simulator = RuntimeSimulator(socket_path, RuntimeSpec(sync_chunk=2),
                                 pods=[pod for pod, _ in views],
                                 containers=[c for _, cs in views for c in cs])
    await simulator.start()
    try:
        await connect(second, socket_path)
        connection = await simulator.wait_ready()
        snapshot = second.agent.state.snapshot()
        assert set(snapshot.pods) == {p.info.id for p in host.pods}
        second.cycle(10.0)
        second.cycle(11.0)

        # From the resctrl tree: the groups that were right are used as they are (no group
        # made or rewritten), the group of the pod that went is removed, once.
        assert second.named("resctrl_group_created") == []
        assert [r["group"] for r in second.named("resctrl_group_removed")] == [
            f"nriqos-pod-{removed_meanwhile.info.uid}"]
        groups_after = sorted(p.name for p in resctrl.iterdir() if p.is_dir())
        assert groups_after == sorted(set(groups_before)
                                      - {f"nriqos-pod-{removed_meanwhile.info.uid}"})
        # No repeated writes: only the pods the first run never saw get tasks moved and
        # processes repaired. A pod created while the plugin was down runs in its level's class
        # group: its own group is made at RunPodSandbox only, which it missed.
        moved = {r["group"]: r["count"] for r in second.named("tasks_moved")}
        assert moved == {"nriqos-shared_cores": len(missed_group.containers[0].tids),
                         "nriqos-reclaimed_cores": len(missed.containers[0].tids)}
        written = {r["path"] for r in second.named("cgroup_write")}
        assert written == {f"/proc/{pid}/oom_score_adj" for pid in missed.containers[0].pids}
        # A new container of the pod with its own group joins that group, as before the restart.
        pod_msg, containers = nri_messages(own_group)
        extra = api.Container(id="f" * 64, pod_sandbox_id=own_group.info.id, name="sidecar")
        extra.linux.cgroups_path = containers[0].linux.cgroups_path.replace(
            containers[0].id, extra.id)
        response = await simulator.send(connection, Event.CREATE_CONTAINER, pod_msg, extra)
        assert isinstance(response, api.CreateContainerResponse)
        assert response.adjust.linux.rdt.clos_id.value == f"nriqos-pod-{own_group.info.uid}"
    finally:
        await stop_instance(second)
        await simulator.stop()


def uid_of(n: int) -> str:
    return f"{n:08x}-1111-4222-8333-444444444444"
