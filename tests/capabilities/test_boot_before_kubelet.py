"""An agent started before kubelet, as at a node's boot (containerd starts pre-launched plugins
before kubelet runs), with ``cgroup_driver = "auto"``: kubelet has made neither
``kubepods.slice`` nor ``kubepods`` yet, so the driver cannot be told. The agent as the daemon
builds it, connected to the runtime simulator, on a fake systemd-driver host whose
``kubepods.slice`` appears after the start: NRI is served meanwhile, and the parts acting on
cgroups start on kubelet's layout once its cgroup is there, never on a guess."""

from __future__ import annotations

import asyncio
import functools
import io
from pathlib import Path
from typing import Any

from common.aio import Backoff
from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.agent import Agent, build_agent, probe, run_agent
from nri_plugin.cli.probe import main_probe, report
from nri_plugin.cli.status import fetch, print_status
from nri_plugin.config.store import ConfigStore
from nri_plugin.connection import run_external
from nri_plugin.session.stub import PluginIdentity
from nri_plugin.sim.simulator import RuntimeSimulator
from tests.support.fakesys import FakeHost
from tests.support.polling import eventually

GIB = 1 << 30
BOUND_S = 10.0
SYSTEMD_BESTEFFORT = "kubepods.slice/kubepods-besteffort.slice/memory.max"


class Node:
    """A systemd-driver host whose kubelet has not made its pods cgroup yet."""

    def __init__(self, tmp_path: Path, sockets: Path, driver: str = "auto") -> None:
        self.host = FakeHost(tmp_path / "host", version=2, driver="systemd")
        self.host.set_numa([(20 * GIB, 64 * GIB, 100)])
        self.host.set_tier_usage("besteffort", GIB)
        self.pods = self.host.cgroup / "kubepods.slice"
        self.held = tmp_path / "kubepods.slice"
        self.pods.rename(self.held)
        self.status_socket = sockets / "status" / "status.sock"
        config = tmp_path / "config.toml"
        config.write_text(f'[agent]\nmode = "enforce"\n'
                          f'[reconciler]\nroot = "{self.host.root}"\n'
                          f'state_dir = "{tmp_path / "state"}"\ncgroup_driver = "{driver}"\n'
                          '[memory_guard]\nstanding_cap = "always"\n'
                          "[resctrl]\nenabled = false\n[kubernetes]\nenabled = false\n"
                          f'[status]\nsocket = "{self.status_socket}"\n'
                          "[metrics]\nenabled = false\n"
                          "[plugin]\nreconnect_initial_ms = 20\n")
        self.sink = MemoryAuditSink()
        audit = AuditLog(self.sink)
        self.store = ConfigStore(audit)
        self.store.load_initial(config)
        found, sysfs = probe(self.store.current, audit)
        self.agent: Agent = build_agent(self.store, audit, found, sysfs,
                                        PluginIdentity("nri-qos", "10"), run_background=True)

    def kubelet_starts(self) -> None:
        self.held.rename(self.pods)

    def caps(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.sink.named("memory_guard_cap")]

    def capped_systemd_tier(self) -> bool:
        return any(str(r["path"]).endswith(SYSTEMD_BESTEFFORT) for r in self.caps())


async def status(node: Node) -> dict[str, Any]:
    return await asyncio.to_thread(fetch, str(node.status_socket))


class Running:
    """The agent connected to the runtime simulator until the block ends."""

    def __init__(self, node: Node, sockets: Path) -> None:
        self.node = node
        self.nri = sockets / "nri.sock"
        self.simulator = RuntimeSimulator(self.nri)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[int] | None = None

    async def __aenter__(self) -> RuntimeSimulator:
        await self.simulator.start()
        connection = functools.partial(run_external, socket_path=str(self.nri),
                                       backoff=Backoff(0.05, 0.1))
        self.task = asyncio.create_task(run_agent(self.node.agent, connection, self.stop))
        # The runtime is served while kubelet's cgroup is missing.
        await self.simulator.wait_ready(timeout_s=BOUND_S)
        return self.simulator

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, BOUND_S)
        await self.simulator.stop()


async def test_an_agent_started_before_kubelet_caps_kubelets_tier_once_its_cgroup_is_there(
        tmp_path: Path, short_dir: Path) -> None:
    node = Node(tmp_path, short_dir)
    async with Running(node, short_dir):
        node.kubelet_starts()
        await eventually(node.capped_systemd_tier, BOUND_S)
    assert all(str(r["path"]).endswith(SYSTEMD_BESTEFFORT) for r in node.caps())


async def test_before_kubelets_cgroup_nothing_acts_and_the_status_says_what_is_awaited(
        tmp_path: Path, short_dir: Path) -> None:
    node = Node(tmp_path, short_dir)
    async with Running(node, short_dir):
        await eventually(lambda: node.status_socket.exists(), BOUND_S)
        await asyncio.sleep(0.5)
        # Nothing acted on a guessed layout.
        assert node.caps() == []
        assert node.agent.tracker.last() == {}
        waiting = await status(node)
        assert waiting["connection"]["state"] == "synchronized"
        assert waiting["reconciler"]["running"] is False
        assert "kubepods.slice" in waiting["reconciler"]["waiting_for"]
        assert waiting["mitigation"] is None
        printed = io.StringIO()
        print_status(waiting, printed)
        assert "reconciler        waiting for kubelet's pods cgroup" in printed.getvalue()
        node.kubelet_starts()
        await eventually(node.capped_systemd_tier, BOUND_S)
        running = await status(node)
        assert running["reconciler"]["running"] is True
        assert running["reconciler"]["waiting_for"] is None
        assert running["mitigation"] is not None


async def test_a_stop_while_waiting_for_kubelet_ends_the_agent(tmp_path: Path,
                                                               short_dir: Path) -> None:
    node = Node(tmp_path, short_dir)
    stop = asyncio.Event()

    async def connection(stub: object, stop: asyncio.Event) -> bool:
        await stop.wait()
        return True

    task = asyncio.create_task(run_agent(node.agent, connection, stop))
    await eventually(lambda: node.status_socket.exists(), BOUND_S)
    stop.set()
    assert await asyncio.wait_for(task, BOUND_S) == 0
    assert node.caps() == []


def test_an_explicit_driver_does_not_wait_for_kubelet(tmp_path: Path, short_dir: Path) -> None:
    node = Node(tmp_path, short_dir, driver="systemd")
    try:
        assert node.agent.evictor is not None
        assert node.agent.mitigation is not None
        assert not node.agent.host.cgroup.awaiting_kubelet
    finally:
        node.agent.executor.shutdown()


def test_the_probe_says_the_driver_waits_for_kubelets_cgroup(tmp_path: Path,
                                                             short_dir: Path) -> None:
    node = Node(tmp_path, short_dir)
    try:
        assert node.agent.evictor is None
        found = report(node.store.current, node.agent.host)
        assert found["cgroup"]["awaiting_kubelet"] is True
        printed = io.StringIO()
        assert main_probe(str(tmp_path / "config.toml"), as_json=False, out=printed) == 0
        assert "cgroup            v2, driver not known yet" in printed.getvalue()
        node.kubelet_starts()
        again, _ = probe(node.store.current, AuditLog(MemoryAuditSink()))
        assert report(node.store.current, again)["cgroup"] == {
            "version": 2, "driver": "systemd", "mount": "/sys/fs/cgroup",
            "awaiting_kubelet": False}
    finally:
        node.agent.executor.shutdown()
