"""Fixtures of the plugin stub's tests: stubs connected to the runtime simulator over a real unix
socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.metrics import PluginMetrics
from common.state import NodeState
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.scenario import RuntimeSpec
from nri_plugin.sim.simulator import RuntimeSimulator
from protos import nri_api_pb2 as api
from tests.support.stub_runtime import Setup


@pytest.fixture
async def make(tmp_path: Path, executor: ThreadPoolExecutor) -> AsyncIterator[object]:
    setups: list[Setup] = []

    async def start(capabilities: Sequence[Capability] = (), *, runtime: RuntimeSpec | None = None,
                    cfg: Config | None = None, pods: Sequence[api.PodSandbox] = (),
                    containers: Sequence[api.Container] = (), wait: bool = True,
                    identity: PluginIdentity | None = None,
                    reconciler_fields: frozenset[str] = frozenset(),
                    metrics: PluginMetrics | None = None) -> Setup:
        socket_path = tmp_path / f"nri-{len(setups)}.sock"
        simulator = RuntimeSimulator(socket_path, runtime, pods=pods, containers=containers)
        await simulator.start()
        sink = MemoryAuditSink()
        current = cfg or Config()
        stub = PluginStub(identity=identity or PluginIdentity("nri-qos", "10"),
                          config=lambda: current, capabilities=capabilities,
                          audit=AuditLog(sink), executor=executor, state=NodeState(),
                          reconciler_fields=reconciler_fields, metrics=metrics)
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        setup = Setup(simulator, stub, sink, asyncio.create_task(stub.serve(reader, writer)))
        setups.append(setup)
        if wait:
            setup.connection = await simulator.wait_ready()
        return setup

    yield start
    for setup in setups:
        setup.stub.close()
        await setup.serving
        await setup.simulator.stop()
