"""The daemon as ``nri-qos run`` starts it, served against a runtime simulator for the length of
a block."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from nri_plugin.cli import daemon
from nri_plugin.sim.simulator import PluginConnection, RuntimeSimulator


@dataclass
class DaemonRun:
    connection: PluginConnection
    # The daemon's exit status, once the block is left.
    status: int | None = None


@asynccontextmanager
async def serving_daemon(config: Path, simulator: RuntimeSimulator,
                         log_level: str = "warning") -> AsyncIterator[DaemonRun]:
    """Start ``simulator`` and the daemon with ``config`` on its socket; yield once the daemon
    has synchronized. Leaving the block stops the daemon (its status kept) and the simulator."""
    await simulator.start()
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.serve(str(config), simulator.socket_path, log_level,
                                            stop=stop, prelaunched=None))
    run: DaemonRun | None = None
    try:
        run = DaemonRun(await simulator.wait_ready())
        yield run
    finally:
        stop.set()
        status = await task
        if run is not None:
            run.status = status
        await simulator.stop()
