"""The daemon and the agent it assembles: config errors, the socket hint, composition, signals."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import json
import signal
import sys
import threading
from pathlib import Path

import pytest

from common.aio import Backoff
from hooks.events import Event
from nri_plugin.agent import build_agent, load_store, probe, run_agent
from nri_plugin.cli import daemon
from nri_plugin.connection import run_external
from nri_plugin.obs.logs import LoggingSetup
from nri_plugin.session.capability import Capability
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.simulator import RuntimeSimulator
from tests.support.paths import REPO


def test_backoff_doubles_up_to_the_cap_and_resets() -> None:
    backoff = Backoff(0.1, 0.35)
    assert [backoff.next() for _ in range(4)] == [0.1, 0.2, 0.35, 0.35]
    assert backoff.failures == 4
    backoff.reset()
    assert backoff.next() == 0.1


async def test_invalid_config_exits_2_with_key_path(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[plugin]\ndeadline_ms = 5\n")
    status = await daemon.serve(str(config), None, None, stop=asyncio.Event(), prelaunched=None)
    assert status == 2
    assert "plugin.deadline_ms" in capsys.readouterr().err


async def test_missing_socket_is_explained_and_retried(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[plugin]\nreconnect_initial_ms = 10\nreconnect_max_ms = 20\n"
                      "[resctrl]\nenabled = false\n[reconciler]\nenabled = false\n"
                      "[status]\nenabled = false\n")
    socket_path = tmp_path / "missing.sock"
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.serve(str(config), str(socket_path), None, stop=stop,
                                            prelaunched=None))
    lines: list[dict[str, object]] = []
    async with asyncio.timeout(15):
        # Only the log tells: poll it, within a bound.
        while len([x for x in lines if x.get("event") == "runtime_socket_unavailable"]) < 2:
            await asyncio.sleep(0.02)
            lines += [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    stop.set()
    assert await task == 0
    hint = next(x for x in lines if x.get("event") == "runtime_socket_unavailable")
    assert hint["path"] == str(socket_path)
    assert "containerd >= 1.7" in str(hint["hint"])
    assert "disable = false" in str(hint["hint"])


class Tracker(Capability):
    name = "tracker"
    events = frozenset({Event.START_CONTAINER})


async def test_services_and_capabilities_join_the_agent(tmp_path: Path) -> None:
    socket_path = tmp_path / "nri.sock"
    simulator = RuntimeSimulator(socket_path)
    await simulator.start()
    stop = asyncio.Event()
    logging_setup = LoggingSetup(level="warning")
    store = load_store(None, logging_setup)
    assert store is not None
    host, sysfs = probe(store.current, logging_setup.audit)
    agent = build_agent(store, logging_setup.audit, host, sysfs, PluginIdentity("nri-qos", "10"),
                        run_background=False)
    # A capability of its own and a service of its own, composed as the daemon composes.
    stub = PluginStub(identity=agent.stub.identity, config=lambda: store.current,
                      capabilities=[Tracker()], audit=agent.audit, executor=agent.executor,
                      state=agent.state)
    frozen: list[int] = []

    async def service(stop: asyncio.Event) -> None:
        # Everything built at startup is out of the collector's way while the agent runs.
        frozen.append(gc.get_freeze_count())
        await stop.wait()

    agent = dataclasses.replace(agent, stub=stub, services=(*agent.services, service))
    connection = functools.partial(run_external, socket_path=str(socket_path),
                                   backoff=Backoff(0.05, 0.1))
    task = asyncio.create_task(run_agent(agent, connection, stop))
    conn = await simulator.wait_ready()
    assert conn.subscribed(Event.START_CONTAINER)
    assert stub.connected
    stop.set()
    assert await task == 0
    assert frozen[0] > 1000
    assert gc.get_freeze_count() == 0
    await simulator.stop()
    logging_setup.close()


async def test_capabilities_run_on_threads_named_for_them() -> None:
    logging_setup = LoggingSetup(level="warning")
    store = load_store(None, logging_setup)
    assert store is not None
    host, sysfs = probe(store.current, logging_setup.audit)
    agent = build_agent(store, logging_setup.audit, host, sysfs, PluginIdentity("nri-qos", "10"),
                        run_background=False)
    try:
        name = agent.executor.submit(lambda: threading.current_thread().name).result(timeout=5)
    finally:
        agent.executor.shutdown()
        logging_setup.close()
    # nri-qos-hook is the OCI hook executable; a thread running capabilities is not one of it.
    assert name.startswith("nri-qos-capability_")


async def test_sighup_reloads_and_sigterm_stops(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[resctrl]\nenabled = false\n[status]\nenabled = false\n")
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nri_plugin", "run", "--config", str(config),
        "--socket", str(tmp_path / "absent.sock"), cwd=REPO,
        stderr=asyncio.subprocess.PIPE,
    )
    assert child.stderr is not None
    events: list[str] = []

    async def until(name: str, count: int = 1) -> None:
        assert child.stderr is not None
        while events.count(name) < count:
            line = await child.stderr.readline()
            assert line, f"exited before {name}: {events}"
            events.append(str(json.loads(line).get("event")))

    async with asyncio.timeout(30):
        await until("runtime_socket_unavailable")
        config.write_text("[resctrl]\nenabled = false\n[plugin]\nstrict = true\n")
        child.send_signal(signal.SIGHUP)
        # The first record is the initial load; the second comes from the reload.
        await until("config_loaded", 2)
        child.send_signal(signal.SIGTERM)
        await until("stopped")
        assert await child.wait() == 0
