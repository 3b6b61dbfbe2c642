"""An agent restarted (an upgrade, a crash, a new configuration rolled out) still gives a
container kubelet's values back.

The runtime shows kubelet's ``oom_score_adj`` and request only at CreateContainer; Synchronize
lists the spec with the agent's answer in it. Two runs of the agent as the daemon builds it, one
after the other on the same state directory, connected to the runtime simulator, on a fake v2
host whose container's processes hold what the runtime applied: the second run takes kubelet's
values, and what drift noted, from the first run's notes, so a reload that turns the score off,
or a restart with a configuration that has it off, gives the processes kubelet's score, not the
first run's answer."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path

from common.aio import Backoff
from common.audit import AuditLog, MemoryAuditSink
from hooks.events import Event
from nri_plugin.agent import Agent, build_agent, probe, run_agent
from nri_plugin.config.store import ConfigStore
from nri_plugin.connection import run_external
from nri_plugin.session.stub import PluginIdentity
from nri_plugin.sim.simulator import RuntimeSimulator
from protos import nri_api_pb2 as api
from reconciler.loops.container_values import NOTES
from reconciler.loops.kubelet_notes import KUBELET_NOTES
from tests.support.fakesys import GIB, MIB, FakeHost, nri_messages
from tests.support.polling import eventually

UID = "77777777-0000-0000-0000-000000000007"
BOUND_S = 10.0
KUBELETS_SCORE = 300
KUBELETS_REQUEST = 64 * MIB
ANSWERED = 500
OOM = "qos.nri-qos.io/oom-score-adj"


class Node:
    """A v2 host with one burstable pod asking for a score by annotation."""

    def __init__(self, tmp_path: Path, sockets: Path) -> None:
        self.host = FakeHost(tmp_path / "host", version=2, driver="cgroupfs")
        self.host.set_numa([(8 * GIB, 16 * GIB, 100)])
        self.pod = self.host.add_pod(UID, tier="burstable", memory_limit=512 * MIB,
                                     annotations={OOM: str(ANSWERED)})
        self.container = self.pod.containers[0]
        self.sandbox, (created,) = nri_messages(self.pod, state=api.CONTAINER_CREATED)
        # As kubelet gives it: its score, and its MemoryQoS request as memory.min.
        created.linux.oom_score_adj.value = KUBELETS_SCORE
        created.linux.resources.unified["memory.min"] = str(KUBELETS_REQUEST)
        self.created = created
        for pid in self.container.pids:
            self.set_score(pid, KUBELETS_SCORE)
        self.state_dir = tmp_path / "state"
        self.config = tmp_path / "config.toml"
        self.nri = sockets / "nri.sock"
        self.write_config(oom=True)

    def write_config(self, *, oom: bool, reconciler: bool = True) -> None:
        self.config.write_text(
            f'[agent]\nmode = "enforce"\n'
            f'[reconciler]\nroot = "{self.host.root}"\nstate_dir = "{self.state_dir}"\n'
            'cgroup_driver = "cgroupfs"\ndrift_interval_s = 0.2\n'
            f"enabled = {'true' if reconciler else 'false'}\n"
            f"[oom]\nenabled = {'true' if oom else 'false'}\n"
            "[resctrl]\nenabled = false\n[kubernetes]\nenabled = false\n"
            "[status]\nenabled = false\n[metrics]\nenabled = false\n"
            "[plugin]\nreconnect_initial_ms = 20\n")

    def agent(self) -> tuple[ConfigStore, Agent]:
        self.sink = MemoryAuditSink()
        audit = AuditLog(self.sink)
        store = ConfigStore(audit)
        store.load_initial(self.config)
        found, sysfs = probe(store.current, audit)
        return store, build_agent(store, audit, found, sysfs, PluginIdentity("nri-qos", "10"),
                                  run_background=True)

    def score(self, pid: int) -> int | None:
        """None while the agent's write is under way (the fake file is truncated, then
        written)."""
        text = (self.host.root / "proc" / str(pid) / "oom_score_adj").read_text().strip()
        return int(text) if text else None

    def scores(self) -> list[int | None]:
        return [self.score(pid) for pid in self.container.pids]

    def set_score(self, pid: int, value: int) -> None:
        (self.host.root / "proc" / str(pid) / "oom_score_adj").write_text(f"{value}\n")

    def noted(self, section: str = KUBELET_NOTES) -> dict[str, str]:
        path = self.state_dir / "state.json"
        if not path.exists():
            return {}
        entries: dict[str, str] = json.loads(path.read_text()).get(section, {})
        return entries


def _drift_cycles(agent: Agent) -> int:
    record = agent.tracker.last().get("drift")
    return 0 if record is None else record.cycles


@contextlib.asynccontextmanager
async def _run(node: Node, simulator: RuntimeSimulator) -> AsyncIterator[Agent]:
    """An agent on the config file as it is now, connected to ``simulator`` until the block
    ends."""
    _, agent = node.agent()
    stop = asyncio.Event()
    await simulator.start()
    connection = functools.partial(run_external, socket_path=str(node.nri),
                                   backoff=Backoff(0.05, 0.1))
    task = asyncio.create_task(run_agent(agent, connection, stop))
    try:
        await simulator.wait_ready(timeout_s=BOUND_S)
        yield agent
    finally:
        stop.set()
        await asyncio.wait_for(task, BOUND_S)
        await simulator.stop()


def _next_run(node: Node, kept: api.Container) -> contextlib.AbstractAsyncContextManager[Agent]:
    """The agent started again, the runtime listing ``kept``."""
    return _run(node, RuntimeSimulator(node.nri, pods=[node.sandbox], containers=[kept]))


async def _first_run(node: Node) -> api.Container:
    """The container created under the first run; the spec the runtime keeps, with the
    answer's score in it."""
    simulator = RuntimeSimulator(node.nri, pods=[node.sandbox])
    async with _run(node, simulator):
        connection = simulator.connections[-1]
        answer = await simulator.send(connection, Event.CREATE_CONTAINER, node.sandbox,
                                      node.created)
        assert isinstance(answer, api.CreateContainerResponse)
        assert answer.adjust.linux.oom_score_adj.value == ANSWERED
        # The runtime applies the answer; its spec holds it from now on.
        kept = api.Container()
        kept.CopyFrom(node.created)
        kept.MergeFrom(api.Container(linux=api.LinuxContainer(
            resources=answer.adjust.linux.resources,
            oom_score_adj=answer.adjust.linux.oom_score_adj)))
        kept.state = api.CONTAINER_RUNNING
        for pid in node.container.pids:
            node.set_score(pid, ANSWERED)
        await simulator.send(connection, Event.START_CONTAINER, node.sandbox, kept)
        await eventually(lambda: bool(node.noted()) and bool(node.noted(NOTES)), BOUND_S)
    return kept


async def test_a_restarted_agent_gives_kubelets_score_back_not_its_own_answer(
        tmp_path: Path, short_dir: Path) -> None:
    node = Node(tmp_path, short_dir)
    kept = await _first_run(node)
    assert node.noted() == {kept.id: f"{KUBELETS_REQUEST},{KUBELETS_SCORE},"}
    assert kept.linux.oom_score_adj.value == ANSWERED
    async with _next_run(node, kept) as agent:
        known = agent.state.container(kept.id)
        assert known is not None
        assert (known.memory_request, known.oom_score_adj) == (KUBELETS_REQUEST, KUBELETS_SCORE)
        # Drift has seen the container: a cycle started after the Synchronize ended.
        seen = _drift_cycles(agent)
        await eventually(lambda: _drift_cycles(agent) >= seen + 2, BOUND_S)
        assert node.scores() == [ANSWERED]
        node.write_config(oom=False)
        assert agent.store.reload()
        await eventually(lambda: node.scores() == [KUBELETS_SCORE], BOUND_S)


async def test_an_agent_restarted_with_the_score_off_gives_kubelets_back(
        tmp_path: Path, short_dir: Path) -> None:
    node = Node(tmp_path, short_dir)
    kept = await _first_run(node)
    assert node.scores() == [ANSWERED]
    # The DaemonSet rolls out with a configuration that turns the score off.
    node.write_config(oom=False)
    async with _next_run(node, kept):
        await eventually(lambda: node.scores() == [KUBELETS_SCORE], BOUND_S)
        await eventually(lambda: not any("oom_score_adj" in note
                                         for note in node.noted(NOTES).values()), BOUND_S)


async def test_an_agent_restarted_with_the_reconciler_off_gives_kubelets_back(
        tmp_path: Path, short_dir: Path) -> None:
    node = Node(tmp_path, short_dir)
    kept = await _first_run(node)
    node.write_config(oom=True, reconciler=False)
    async with _next_run(node, kept):
        await eventually(lambda: node.scores() == [KUBELETS_SCORE], BOUND_S)
        await eventually(lambda: not node.noted(NOTES) and not node.noted(), BOUND_S)
