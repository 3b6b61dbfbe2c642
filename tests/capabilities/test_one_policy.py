"""One policy, two appliers: the CreateContainer answer and the task-id loop place a container in
the same resctrl group, with the same level, also after the pod's level annotation changed."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import PodMeta
from common.state import NodeState
from hooks.events import Event
from hooks.levels import LEVEL_NAMES
from hooks.resctrl_groups import place_container
from nri_plugin.capabilities import build_capabilities
from nri_plugin.config.schema import Config
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.simulator import RuntimeSimulator
from protos import nri_api_pb2 as api
from reconciler.host.cgroups import layout_for
from reconciler.host.resctrlfs import ResctrlFs, read_info
from reconciler.host.sysfs import SysFs
from reconciler.loops.common import ManagedCache
from reconciler.loops.resctrl_tasks import ResctrlTasksLoop
from tests.support.builders import LEVEL
from tests.support.fakesys import FakeHost, read_ids

UID = "0d0d0d0d-1111-2222-3333-444444444444"


def meta(level: str) -> PodMeta:
    return PodMeta(uid=UID, namespace="ns", name="p", annotations={LEVEL: level}, labels={},
                   priority=None, memory_requests={}, memory_limits={})


async def test_creation_and_reconcile_agree_before_and_after_an_annotation_change(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    root = host.make_resctrl()
    for level in LEVEL_NAMES:
        host.add_resctrl_group("nriqos-" + level)
    pod = host.add_pod(UID, tier="burstable", annotations={LEVEL: "shared_cores"},
                       containers=2)
    cfg = Config()
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit)
    mount = "/" + str(root.relative_to(tmp_path))
    fs = ResctrlFs(sysfs, mount, read_info(sysfs, mount, 2048), prefix="nriqos-", audit=audit)
    state = NodeState(qos=lambda: cfg.qos)
    loop = ResctrlTasksLoop(lambda: cfg, state, sysfs, layout_for(sysfs), fs, audit)
    capabilities = build_capabilities(cfg, resctrl=fs, state=state, audit=audit,
                                      cgroup_v2=False, memory_total=0)
    simulator = RuntimeSimulator(tmp_path / "nri.sock")
    await simulator.start()
    with ThreadPoolExecutor(2) as executor:
        stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: cfg,
                          capabilities=capabilities, audit=audit, executor=executor, state=state,
                          track_containers=True)
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "nri.sock"))
        async with asyncio.TaskGroup() as group:
            serving = group.create_task(stub.serve(reader, writer))
            connection = await simulator.wait_ready()
            message = api.PodSandbox(id=pod.info.id, uid=UID, name="p", namespace="ns",
                                     annotations=dict(pod.info.annotations))
            message.linux.cgroup_parent = pod.info.cgroup_parent

            async def create(n: int) -> str:
                ctr = pod.containers[n].info
                container = api.Container(id=ctr.id, pod_sandbox_id=pod.info.id, name=ctr.name)
                container.linux.cgroups_path = ctr.cgroups_path
                answer = await simulator.send(connection, Event.CREATE_CONTAINER, message,
                                              container)
                assert isinstance(answer, api.CreateContainerResponse)
                await simulator.send(connection, Event.START_CONTAINER, message, container)
                return answer.adjust.linux.rdt.clos_id.value

            await simulator.send(connection, Event.RUN_POD_SANDBOX, message)
            created = await create(0)
            loop.cycle(0.0)
            assert created == "nriqos-shared_cores"
            assert set(pod.containers[0].tids) <= set(read_ids(root / created / "tasks"))

            # The level annotation changes through the API (down: up is refused): the next
            # container's answer and the loop both follow it, and both read it from the same
            # place.
            state.apply_meta(meta("reclaimed_cores"))
            created_after = await create(1)
            loop.cycle(1.0)
            assert created_after == "nriqos-reclaimed_cores"
            for container in pod.containers:
                assert set(container.tids) <= set(read_ids(root / created_after / "tasks"))
            managed = ManagedCache().get(state.snapshot())
            assert {m.level for m in managed} == {"reclaimed_cores"}
            assert {place_container(f"nriqos-pod-{UID}", m.level, cfg.resctrl,
                                    fs.has_group).group for m in managed} == {created_after}
            stub.close()
            await serving
    await simulator.stop()
