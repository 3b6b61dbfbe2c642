"""``nri-qos run``: the long-running plugin process.

One :class:`asyncio.TaskGroup` runs the runtime connection, the config watcher and any extra
services handed in (the reconciler). Two ways to reach the runtime:

* external (the default): connect to the NRI socket, and reconnect with capped exponential
  backoff whenever the runtime goes away, going through registration and synchronization again;
* pre-launched: the runtime started us from its plugin directory and passed one end of a
  socketpair as ``NRI_PLUGIN_SOCKET``; there is no reconnecting, the process ends with the
  connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
from collections.abc import Callable, Coroutine, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from nri_plugin.audit import AuditLog
from nri_plugin.capabilities import build_hooks, setup_class_groups
from nri_plugin.chain import Hook
from nri_plugin.config.loader import ConfigError
from nri_plugin.config.schema import Config
from nri_plugin.config.store import ConfigStore
from nri_plugin.logs import LoggingSetup
from nri_plugin.stub import PluginIdentity, PluginStub
from reconciler.cgroups import detect_version
from reconciler.k8s import PodWatcher, build_api_client, node_name
from reconciler.numa import mem_total
from reconciler.resctrlfs import ResctrlFs
from reconciler.runner import run_reconciler, sysfs_for
from reconciler.state import NodeState, StateTracker
from reconciler.sysfs import SysFs

ENV_SOCKET = "NRI_PLUGIN_SOCKET"
ENV_NAME = "NRI_PLUGIN_NAME"
ENV_INDEX = "NRI_PLUGIN_IDX"
HOOK_THREADS = 4
"""Worker threads running hook chains; more than one so a hook stuck past its deadline does not
hold up the next event."""

log = structlog.get_logger("nri_qos.daemon")

Service = Callable[["ServiceContext"], Coroutine[Any, Any, None]]
"""An extra long-running service started in the daemon's TaskGroup; it must return once
``context.stop`` is set."""


@dataclass(frozen=True, slots=True)
class ServiceContext:
    """What an extra service gets: the live config, the plugin (for UpdateContainers), the audit
    trail and the stop signal."""

    store: ConfigStore
    stub: PluginStub
    audit: AuditLog
    stop: asyncio.Event


@dataclass(frozen=True, slots=True)
class Prelaunched:
    """The runtime started this process and handed it a connected socket."""

    fd: int
    name: str
    index: str


def take_prelaunched_env(environ: MutableMapping[str, str]) -> Prelaunched | None:
    """Read and remove the ``NRI_PLUGIN_*`` variables (children must not inherit them).

    Runtimes with NRI 0.3 pass the file name ``NN-name`` as the name; the index prefix is
    stripped. Raises ValueError when the socket variable is not a file descriptor number.
    """
    fd_text = environ.pop(ENV_SOCKET, None)
    name = environ.pop(ENV_NAME, "")
    index = environ.pop(ENV_INDEX, "")
    if fd_text is None:
        return None
    if not fd_text.isdigit():
        raise ValueError(f"{ENV_SOCKET}={fd_text!r} is not a file descriptor number")
    if len(name) > 3 and name[:2].isdigit() and name[2] == "-":
        index = index or name[:2]
        name = name[3:]
    return Prelaunched(int(fd_text), name, index)


class Backoff:
    """Capped exponential delays: initial, 2x initial, ... up to the cap."""

    def __init__(self, initial_ms: int, max_ms: int) -> None:
        self._initial = initial_ms / 1000
        self._max = max_ms / 1000
        self._next = self._initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self._max)
        return delay

    def reset(self) -> None:
        self._next = self._initial


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


async def _serve_until_stopped(stub: PluginStub, reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter, stop: asyncio.Event) -> str:
    serving = asyncio.create_task(stub.serve(reader, writer))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not serving.done():
            stub.close("plugin stopping")
    return await serving


async def run_external(stub: PluginStub, socket_path: str, stop: asyncio.Event,
                       backoff: Backoff) -> None:
    """Stay connected to the runtime at ``socket_path`` until ``stop`` is set."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_unix_connection(socket_path)
        except OSError as exc:
            delay = backoff.next()
            log.warning(
                "runtime_socket_unavailable", path=socket_path, error=str(exc),
                hint="is containerd >= 1.7 running with NRI enabled "
                     "([plugins.\"io.containerd.nri.v1.nri\"] disable = false) and its "
                     "socket_path set to this path?",
                retry_in_s=delay,
            )
            await _sleep_unless(stop, delay)
            continue
        log.info("runtime_connected", path=socket_path)
        # serve() only returns once this socket is closed, so a reconnect never leaves two
        # registrations alive.
        reason = await _serve_until_stopped(stub, reader, writer, stop)
        if stop.is_set():
            break
        if stub.synchronized.is_set():
            backoff.reset()
        delay = backoff.next()
        log.warning("runtime_disconnected", reason=reason, retry_in_s=delay)
        await _sleep_unless(stop, delay)


async def run_prelaunched(stub: PluginStub, fd: int, stop: asyncio.Event) -> bool:
    """Serve the inherited socket until the runtime closes it (or ``stop``); no reconnecting.

    False when the inherited socket could not be used at all."""
    try:
        sock = socket.socket(fileno=fd)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
    except OSError as exc:
        log.error("inherited_socket_unusable", fd=fd, variable=ENV_SOCKET, error=str(exc))
        stop.set()
        return False
    reason = await _serve_until_stopped(stub, reader, writer, stop)
    log.info("runtime_connection_ended", reason=reason)
    stop.set()
    return True


def _identity(cfg: Config, prelaunched: Prelaunched | None) -> PluginIdentity:
    if prelaunched is None:
        return PluginIdentity(cfg.plugin.name, cfg.plugin.index)
    # The runtime goes by the file name anyway; use it so logs on both sides agree.
    return PluginIdentity(prelaunched.name or cfg.plugin.name,
                          prelaunched.index or cfg.plugin.index)


@dataclass(frozen=True, slots=True)
class HostSetup:
    """What probing the host gave: the capabilities to run and the system layers they share."""

    hooks: list[Hook]
    cgroup_v2: bool
    sysfs: SysFs
    resctrl: ResctrlFs | None


def host_setup(cfg: Config, store: ConfigStore, audit: AuditLog, *,
               simulated: bool = False) -> HostSetup:
    """The enabled capabilities for this host, and the layers that touch it.

    Probes the host (through the sysfs layer, rooted at ``reconciler.root``) for the cgroup
    version, the memory size and resctrl; resctrl class groups are set up now and again on
    every config reload. ``simulated``: the pods are not on this host (the simulator), so an
    ``auto`` cgroup version means v2, the common case, instead of this host's.
    """
    sysfs = sysfs_for(cfg, audit)
    if simulated and cfg.memory.cgroup_version == "auto":
        cgroup_v2 = True
    else:
        cgroup_v2 = detect_version(sysfs, cfg.memory.cgroup_version) == 2
    node_memory = mem_total(sysfs)
    resctrl = None
    if cfg.resctrl.enabled:
        def warn(message: str) -> None:
            log.warning("resctrl_unavailable", reason=message)

        root = os.path.join(cfg.reconciler.root, cfg.resctrl.root.lstrip("/"))
        resctrl = ResctrlFs.detect(root, prefix=cfg.resctrl.group_prefix,
                                   audit=audit, amd_mb_max=cfg.resctrl.amd_mb_max, warn=warn)
        if resctrl is not None:
            fs = resctrl
            setup_class_groups(cfg.resctrl, fs, warn=warn)

            def refresh(old: Config, new: Config) -> None:
                setup_class_groups(new.resctrl, fs, warn=warn)

            store.subscribe(refresh)
    hooks = build_hooks(cfg, resctrl=resctrl, audit=audit, cgroup_v2=cgroup_v2,
                        node_allocatable=node_memory)
    return HostSetup(hooks, cgroup_v2, sysfs, resctrl)


def reconciler_service(state: NodeState, host: HostSetup) -> Service:
    """The background reconciler (and the Kubernetes pod watch) as a daemon service."""
    async def run(context: ServiceContext) -> None:
        cfg = context.store.current
        api = build_api_client(cfg.kubernetes)
        watcher = None if api is None else PodWatcher(api, cfg.kubernetes,
                                                      node_name(cfg.kubernetes))
        await run_reconciler(context.store, state, host.sysfs, host.resctrl, context.audit,
                             context.stop, watcher)

    return run


async def serve(
    config_path: str | None,
    socket_path: str | None,
    log_level: str | None,
    *,
    stop: asyncio.Event,
    prelaunched: Prelaunched | None,
    extra_services: Sequence[Service] = (),
    extra_hooks: Sequence[Hook] = (),
    hooks: Sequence[Hook] | None = None,
    reload_on_sighup: bool = False,
    reconcile: bool = False,
    simulated: bool = False,
) -> int:
    """Load the config, then run every service until ``stop`` is set; the exit status.

    ``extra_services`` run in the same TaskGroup as the runtime connection; ``extra_hooks`` go
    at the end of the chain. ``hooks`` replaces the
    capability hooks built for this host (tests and benchmarks). ``reconcile`` adds the
    background reconciler, fed by a state tracker at the head of the chain; it needs the host
    (``hooks`` left to None) and is off for the simulator, whose pods do not exist
    (``simulated``).
    """
    logging_setup = LoggingSetup(level=log_level)
    audit = logging_setup.audit
    store = ConfigStore(audit)
    try:
        store.load_initial(config_path)
    except ConfigError as exc:
        log.error("config_invalid", source=exc.source or config_path, errors=list(exc.errors),
                  hint="check the file with: nri-qos check-config PATH")
        return 2
    cfg = store.current
    logging_setup.apply(cfg.logging)
    store.subscribe(lambda old, new: logging_setup.apply(new.logging))
    services = list(extra_services)
    if hooks is None:
        host = host_setup(cfg, store, audit, simulated=simulated)
        chain, cgroup_v2 = list(host.hooks), host.cgroup_v2
        if reconcile:
            state = NodeState()
            # First: it changes no adjustment, and a slow hook after it cannot make it miss an
            # event when the deadline cuts the chain short.
            chain.insert(0, StateTracker(state))
            services.append(reconciler_service(state, host))
    else:
        chain, cgroup_v2 = list(hooks), cfg.memory.cgroup_version == "v2"
    chain += extra_hooks

    def reconfigure(old: Config, new: Config) -> None:
        for hook in chain:
            hook.reconfigure(new)

    store.subscribe(reconfigure)
    executor = ThreadPoolExecutor(max_workers=HOOK_THREADS, thread_name_prefix="nri-qos-hook")
    stub = PluginStub(identity=_identity(cfg, prelaunched), config=lambda: store.current,
                      hooks=chain, audit=audit, executor=executor, cgroup_v2=cgroup_v2)
    log.info("starting", plugin=f"{stub.identity.index}-{stub.identity.name}",
             hooks=[hook.name for hook in chain], config=store.source,
             mode="pre-launched" if prelaunched else "external")
    context = ServiceContext(store=store, stub=stub, audit=audit, stop=stop)
    # What exists by now (modules, the Kubernetes client, config, hooks) lives as long as the
    # process. Out of the collector's generations, it is never scanned again: a full collection
    # would otherwise walk it all (some 30 ms), in the middle of whichever CreateContainer
    # triggered it. Garbage is collected first so that none of it is kept for good.
    if reload_on_sighup:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, store.request_reload)
    connection: asyncio.Task[bool] | None = None
    gc.collect()
    gc.freeze()
    try:
        async with asyncio.TaskGroup() as group:
            if prelaunched is not None:
                connection = group.create_task(run_prelaunched(stub, prelaunched.fd, stop))
            else:
                path = socket_path or cfg.plugin.socket
                backoff = Backoff(cfg.plugin.reconnect_initial_ms, cfg.plugin.reconnect_max_ms)
                group.create_task(run_external(stub, path, stop, backoff))
            group.create_task(store.watch(stop))
            # Further services (the reconciler) join here, each handed the same context.
            for service in services:
                group.create_task(service(context))
    finally:
        gc.unfreeze()
        executor.shutdown(wait=False, cancel_futures=True)
        log.info("stopped")
        logging_setup.close()
    return 1 if connection is not None and connection.result() is False else 0


def main_run(config_path: str | None, socket_path: str | None, log_level: str | None) -> int:
    """``nri-qos run``: serve until SIGTERM/SIGINT; SIGHUP reloads the config."""
    try:
        prelaunched = take_prelaunched_env(os.environ)
    except ValueError as exc:
        structlog.get_logger("nri_qos").error("prelaunched_env_invalid", error=str(exc))
        return 2
    return asyncio.run(_main(config_path, socket_path, log_level, prelaunched))


async def _main(config_path: str | None, socket_path: str | None, log_level: str | None,
                prelaunched: Prelaunched | None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return await serve(config_path, socket_path, log_level, stop=stop, prelaunched=prelaunched,
                       reload_on_sighup=True, reconcile=True)
