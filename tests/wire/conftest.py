"""Fixtures of the hostile-runtime tests: a stub serving one end of a socket pair, the operational
log as JSON lines, and traced memory."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import os
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from nri_plugin.obs.logs import LoggingConfig, LoggingSetup
from nri_plugin.session.stub import PluginIdentity, PluginStub
from tests.support.hostile_runtime import Start
from tests.support.raw_runtime import Session, plugin_config, socket_pair


@pytest.fixture
async def session(executor: ThreadPoolExecutor) -> AsyncIterator[Start]:
    """A stub serving one end of a socket pair; the test plays the runtime at the other."""
    made: list[Session] = []

    async def start(cfg: Config | None = None, *, state: NodeState | None = None,
                    audit: AuditLog | None = None) -> Session:
        current = cfg or plugin_config()
        sink = MemoryAuditSink()
        node = state or NodeState()
        stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: current,
                          capabilities=[], audit=audit or AuditLog(sink), executor=executor,
                          state=node)
        reader, writer, runtime = await socket_pair()
        made.append(Session(stub, runtime, asyncio.create_task(stub.serve(reader, writer)),
                            sink, node))
        return made[-1]

    yield start
    for made_session in made:
        made_session.stub.close()
        made_session.runtime.close()
        await made_session.serving


@pytest.fixture
def log_lines() -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """The operational log as JSON lines, from here on."""
    stream = io.StringIO()
    setup = LoggingSetup(LoggingConfig(format="json"), level="info", stream=stream)

    def lines() -> list[dict[str, Any]]:
        return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]

    yield lines
    setup.close()


@pytest.fixture
def traced() -> Iterator[Callable[[], int]]:
    """tracemalloc on for the test; returns the traced memory now (after a collection). Logs go
    nowhere meanwhile: a log kept in memory would count."""
    devnull = open(os.devnull, "w")  # noqa: SIM115 (closed below, after the logging setup)
    setup = LoggingSetup(LoggingConfig(format="json"), level="info", stream=devnull)
    tracemalloc.start()

    def now() -> int:
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    yield now
    tracemalloc.stop()
    setup.close()
    devnull.close()
