"""``nri-qos run``: the long-running agent process.

Loads the configuration, sets up logging, probes the host once, assembles the agent
(:mod:`nri_plugin.agent`) and runs it until the stop event (SIGTERM or SIGINT); SIGHUP reloads the
configuration.
How the runtime is reached is :mod:`nri_plugin.connection`'s business.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import threading

import structlog

from common.aio import Backoff
from common.audit import AuditLog
from nri_plugin.agent import Connection, build_agent, load_store, probe, run_agent
from nri_plugin.allocator import return_large_blocks
from nri_plugin.code_pages import release_code_pages
from nri_plugin.config.schema import Config
from nri_plugin.config.store import ConfigStore
from nri_plugin.connection import Prelaunched, run_external, run_prelaunched, take_prelaunched_env
from nri_plugin.obs.logs import LoggingSetup
from nri_plugin.report.status import another_agent_answers
from nri_plugin.scheduling import set_scheduling
from nri_plugin.session.stub import PluginIdentity

log = structlog.get_logger("nri_qos.daemon")

EXIT_WAIT_S = 5.0
"""How long the process, once the agent stopped, waits for worker threads still blocked in the
kernel (a write to a memory limit in reclaim) before it exits without them: the interpreter
would wait for them for good, past the DaemonSet's 45 s and the systemd unit's 20 s to stop, and
end killed. What such a thread was to restore stays noted in the state file for the next
start."""


def identity_for(cfg: Config, prelaunched: Prelaunched | None) -> PluginIdentity:
    if prelaunched is None:
        return PluginIdentity(cfg.plugin.name, cfg.plugin.index)
    # The runtime goes by the file name anyway; use it so logs on both sides agree.
    return PluginIdentity(prelaunched.name or cfg.plugin.name,
                          prelaunched.index or cfg.plugin.index)


def connection_for(cfg: Config, socket_path: str | None,
                   prelaunched: Prelaunched | None) -> Connection:
    if prelaunched is not None:
        return functools.partial(run_prelaunched, fd=prelaunched.fd)
    backoff = Backoff(cfg.plugin.reconnect_initial_ms / 1000, cfg.plugin.reconnect_max_ms / 1000)
    return functools.partial(run_external, socket_path=socket_path or cfg.plugin.socket,
                             backoff=backoff)


async def serve(config_path: str | None, socket_path: str | None, log_level: str | None, *,
                stop: asyncio.Event, prelaunched: Prelaunched | None,
                allow_second_agent: bool = False, metrics_address: str | None = None) -> int:
    """Load the config, then run the agent until ``stop`` is set; the exit status (1 without
    starting when another agent answers on the status socket, unless ``allow_second_agent``)."""
    # A runtime's large messages must not leave their memory behind (see nri_plugin.allocator).
    return_large_blocks()
    logging_setup = LoggingSetup(level=log_level)
    audit = logging_setup.audit
    try:
        store = load_store(config_path, logging_setup)
        if store is None:
            return 2
        loop = asyncio.get_running_loop()
        # From here on, not only once the agent runs: SIGHUP's default action ends the process,
        # and a reload asked for while the host is probed (``systemctl reload`` right after a
        # start) is a request for the configuration watch to take up when it starts.
        loop.add_signal_handler(signal.SIGHUP, store.request_reload)
        try:
            return await _serve(store, audit, socket_path, prelaunched=prelaunched,
                                allow_second_agent=allow_second_agent,
                                metrics_address=metrics_address, stop=stop)
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
    finally:
        logging_setup.close()


async def _serve(store: ConfigStore, audit: AuditLog, socket_path: str | None, *,
                 prelaunched: Prelaunched | None, allow_second_agent: bool,
                 metrics_address: str | None, stop: asyncio.Event) -> int:
    """The agent of ``store``'s configuration, run until ``stop``; the exit status."""
    cfg = store.current
    # Before any thread starts: every thread inherits it (see nri_plugin.scheduling).
    refused = set_scheduling(cfg.agent.scheduling)
    if refused is None:
        log.info("scheduling_set", policy=cfg.agent.scheduling)
    else:
        log.warning("scheduling_refused", policy=cfg.agent.scheduling, error=str(refused),
                    hint="the agent runs under the kernel's default policy")
    if (cfg.status.enabled and not allow_second_agent
            and await another_agent_answers(cfg.status.socket)):
        # Two agents would both register with the runtime and adjust every container.
        log.error("agent_already_running", status_socket=cfg.status.socket,
                  hint="another nri-qos agent answers on this node's status socket (see "
                       "`nri-qos status`); stop it first, or pass --allow-second-agent to "
                       "start anyway")
        return 1
    host, sysfs = probe(cfg, audit)
    agent = build_agent(store, audit, host, sysfs, identity_for(cfg, prelaunched),
                        run_background=True, metrics_address=metrics_address)
    # Every module the agent runs is loaded by now (see nri_plugin.code_pages).
    log.info("code_pages_released", files=release_code_pages(list(sys.modules.values())))
    log.info("mode", mode="pre-launched" if prelaunched else "external")
    return await run_agent(agent, connection_for(cfg, socket_path, prelaunched), stop)


def main_run(config_path: str | None, socket_path: str | None, log_level: str | None, *,
             allow_second_agent: bool = False, metrics_address: str | None = None) -> int:
    """``nri-qos run``: serve until SIGTERM/SIGINT; SIGHUP reloads the config."""
    try:
        prelaunched = take_prelaunched_env(os.environ)
    except ValueError as exc:
        structlog.get_logger("nri_qos").error("prelaunched_env_invalid", error=str(exc))
        return 2
    return asyncio.run(_main(config_path, socket_path, log_level, prelaunched,
                             allow_second_agent, metrics_address))


def exit_within(status: int, wait_s: float) -> None:
    """The process is about to exit: should that take more than ``wait_s`` (the interpreter
    waits for every worker thread, and one may be blocked in the kernel), it ends then, with
    ``status``. Called once the agent stopped, by the process's entry point only."""
    def force() -> None:
        left = [thread.name for thread in threading.enumerate()
                if not thread.daemon and thread is not threading.main_thread()
                and thread.is_alive()]
        # The agent's logging is gone by now: said as a failure before it is set up is said.
        structlog.get_logger("nri_qos").warning(
            "exit_threads_left", threads=left, waited_s=wait_s,
            hint="blocked in the kernel; what they were to restore is noted in the state file "
                 "for the next start or nri-qos reset")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    timer = threading.Timer(wait_s, force)
    timer.name = "nri-qos-exit"
    timer.daemon = True
    timer.start()


async def _main(config_path: str | None, socket_path: str | None, log_level: str | None,
                prelaunched: Prelaunched | None, allow_second_agent: bool,
                metrics_address: str | None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    status = await serve(config_path, socket_path, log_level, stop=stop, prelaunched=prelaunched,
                         allow_second_agent=allow_second_agent, metrics_address=metrics_address)
    # From here asyncio.run waits for the threads of its default executor, and the interpreter
    # for every other worker thread.
    exit_within(status, EXIT_WAIT_S)
    return status
