"""A pod removed while the plugin was not connected (a runtime restart, the agent's own restart
or upgrade) gets no RemovePodSandbox: its resctrl pod group goes at the Synchronize that no
longer lists it, also where no task-id loop collects orphans (the reconciler switched off), or
every such pod would keep one of the few CLOS for good. The agent as the daemon builds it, on a
fake host, served over a real unix socket by the runtime simulator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from hooks.events import Event
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION
from nri_plugin.agent import Agent, build_agent, probe
from nri_plugin.config.store import ConfigStore
from nri_plugin.session.stub import PluginIdentity
from nri_plugin.sim.simulator import RuntimeSimulator
from protos import nri_api_pb2 as api
from tests.support.fakesys import FakeHost

GONE = "1a2b3c4d-0000-4000-8000-00000000000a"
STAYS = "1a2b3c4d-0000-4000-8000-00000000000b"
RECORDED = '{"LLC":{"schemata":{"range":[20,80]}},"MB":{"schemata":{"percent":20}}}'


def sandbox(uid: str) -> api.PodSandbox:
    """A Burstable pod asking for a resctrl group of its own."""
    message = api.PodSandbox(id=f"sb-{uid}", uid=uid, name=f"p-{uid[-1]}", namespace="ns",
                             annotations={KOORDINATOR_ANNOTATION: RECORDED})
    message.linux.cgroup_parent = f"/kubepods/burstable/pod{uid}"
    return message


class Served:
    """The agent's stub, connected to the simulator once per :meth:`connect`."""

    def __init__(self, tmp_path: Path, reconciler: bool) -> None:
        self.host = FakeHost(tmp_path / "host")
        self.resctrl = self.host.make_resctrl()
        config = tmp_path / "config.toml"
        config.write_text('[agent]\nmode = "enforce"\n'
                          f'[reconciler]\nenabled = {str(reconciler).lower()}\n'
                          f'root = "{self.host.root}"\nstate_dir = "{tmp_path / "state"}"\n'
                          "[kubernetes]\nenabled = false\n[status]\nenabled = false\n")
        self.sink = MemoryAuditSink()
        audit = AuditLog(self.sink)
        store = ConfigStore(audit)
        store.load_initial(config)
        host, sysfs = probe(store.current, audit)
        self.agent: Agent = build_agent(store, audit, host, sysfs,
                                        PluginIdentity("nri-qos", "10"), run_background=False)
        self.simulator = RuntimeSimulator(tmp_path / "nri.sock",
                                          pods=[sandbox(GONE), sandbox(STAYS)])
        self.serving: asyncio.Task[str] | None = None

    async def connect(self, count: int) -> None:
        await self.simulator.start()
        reader, writer = await asyncio.open_unix_connection(self.simulator.socket_path)
        self.serving = asyncio.create_task(self.agent.stub.serve(reader, writer))
        await self.simulator.wait_ready(count=count)

    async def disconnect(self) -> None:
        await self.simulator.stop()
        if self.serving is not None:
            await self.serving
            self.serving = None

    def pod_groups(self) -> list[str]:
        return sorted(p.name for p in self.resctrl.iterdir() if "-pod-" in p.name)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    made = Served(tmp_path, reconciler=False)
    yield made
    await made.disconnect()
    made.agent.executor.shutdown()


async def test_the_group_of_a_pod_removed_while_disconnected_goes_at_the_next_synchronize(
        served: Served) -> None:
    await served.connect(1)
    for uid in (GONE, STAYS):
        await served.simulator.send(served.simulator.connections[-1], Event.RUN_POD_SANDBOX,
                                    sandbox(uid))
    assert served.pod_groups() == [f"nriqos-pod-{GONE}", f"nriqos-pod-{STAYS}"]
    await served.disconnect()

    served.simulator.pods = [sandbox(STAYS)]
    await served.connect(2)
    assert served.pod_groups() == [f"nriqos-pod-{STAYS}"]
    removed = served.sink.named("resctrl_group_removed")
    assert [r["group"] for r in removed] == [f"nriqos-pod-{GONE}"]
