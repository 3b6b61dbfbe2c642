"""Restarts on either side of the NRI connection: the runtime restarting while pods are created
resynchronizes once, and the plugin restarting on a node whose resctrl groups it made before
rebuilds its state without leaks or repeated writes."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.aio import Backoff
from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.events import Event
from nri_plugin.agent import Agent, build_agent, probe
from nri_plugin.config.store import ConfigStore
from nri_plugin.connection import run_external
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.scenario import RuntimeSpec
from nri_plugin.sim.simulator import RuntimeSimulator
from nri_plugin.wire.errors import ConnectionClosed
from protos import nri_api_pb2 as api
from reconciler.host.resctrlfs import ResctrlFs
from reconciler.loops.base import Loop
from reconciler.runner import build_loops
from tests.support.fakesys import FakeHost, nri_messages
from tests.support.nri_faults import Quick
from tests.support.raw_runtime import container_message, plugin_config, pod_message

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
