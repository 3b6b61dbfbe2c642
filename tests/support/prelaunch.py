"""The runtime's side of a pre-launched plugin: what containerd does with a plugin it started."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from hooks.events import Event
from nri_plugin.sim.simulator import RuntimeSimulator
from protos import nri_api_pb2 as api


async def create_one_container_then_go(runtime_end: socket.socket, tmp_path: Path) -> None:
    """Serve the plugin on ``runtime_end`` (the socketpair end the runtime keeps): handshake,
    one CreateContainer of a BestEffort pod, then the runtime goes away, which ends a
    pre-launched plugin (no reconnecting)."""
    simulator = RuntimeSimulator(tmp_path / "unused.sock")
    reader, writer = await asyncio.open_unix_connection(sock=runtime_end)
    adopted = asyncio.create_task(simulator.adopt(reader, writer))
    try:
        connection = await simulator.wait_ready(timeout_s=30)
        assert (connection.name, connection.index) == ("nri-qos", "10")
        pod = api.PodSandbox(id="sb", uid="u", name="p", namespace="ns")
        pod.linux.cgroup_parent = "/kubepods/besteffort/podu"
        response = await simulator.send(connection, Event.CREATE_CONTAINER, pod,
                                        api.Container(id="c", pod_sandbox_id="sb", name="c"))
        assert isinstance(response, api.CreateContainerResponse)
        # Default oom policy: reclaimed_cores (besteffort) containers get 1000.
        assert response.adjust.linux.oom_score_adj.value == 1000
    finally:
        for peer in [c.peer for c in simulator.connections if c.peer is not None]:
            peer.close("runtime exiting")
        await adopted
