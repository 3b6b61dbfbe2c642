"""Reaching the runtime, two ways, and staying connected.

* External (the default): connect to the NRI socket, and reconnect with capped exponential
  backoff whenever the runtime goes away, going through registration and synchronization again.
  :meth:`~nri_plugin.session.stub.PluginStub.serve` returns only once the old socket is closed, so a
  reconnect never leaves two registrations alive.
* Pre-launched: the runtime started this process from its plugin directory and passed one end of
  a socketpair as ``NRI_PLUGIN_SOCKET``; there is no reconnecting, the process ends with the
  connection.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass

import structlog

from common.aio import Backoff, sleep_until
from nri_plugin.session.stub import PluginStub

ENV_SOCKET = "NRI_PLUGIN_SOCKET"
ENV_NAME = "NRI_PLUGIN_NAME"
ENV_INDEX = "NRI_PLUGIN_IDX"
MAX_FD = 2**31 - 1
"""The largest file descriptor number (a C int)."""

log = structlog.get_logger("nri_qos.daemon")


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
    # ASCII digits only (str.isdigit also takes "²"), within a C int: socket() raises
    # ValueError or OverflowError for larger numbers, which would end the daemon with a traceback.
    if not (fd_text.isascii() and fd_text.isdigit() and len(fd_text) <= len(str(MAX_FD))
            and int(fd_text) <= MAX_FD):
        raise ValueError(f"{ENV_SOCKET}={fd_text!r} is not a file descriptor number")
    if len(name) > 3 and name[:2].isdigit() and name[2] == "-":
        index = index or name[:2]
        name = name[3:]
    return Prelaunched(int(fd_text), name, index)


async def serve_until_stopped(stub: PluginStub, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter, stop: asyncio.Event) -> str:
    """Serve one connection until it ends or ``stop`` is set; why it ended."""
    async with asyncio.TaskGroup() as group:
        serving = group.create_task(stub.serve(reader, writer))

        async def close_on_stop() -> None:
            await stop.wait()
            stub.close("plugin stopping")

        closer = group.create_task(close_on_stop())
        serving.add_done_callback(lambda _: closer.cancel())
    return serving.result()


async def run_external(stub: PluginStub, stop: asyncio.Event, *, socket_path: str,
                       backoff: Backoff) -> bool:
    """Stay connected to the runtime at ``socket_path`` until ``stop`` is set."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_unix_connection(socket_path)
        except OSError as exc:
            delay = backoff.next()
            hint = _hint(exc)
            log.warning("runtime_socket_unavailable", path=socket_path, error=str(exc),
                        hint=hint, retry_in_s=delay)
            await sleep_until(delay, stop)
            continue
        log.info("runtime_connected", path=socket_path)
        reason = await serve_until_stopped(stub, reader, writer, stop)
        if stop.is_set():
            break
        if stub.handshake.synchronized.is_set():
            backoff.reset()
        delay = backoff.next()
        log.warning("runtime_disconnected", reason=reason, retry_in_s=delay)
        await sleep_until(delay, stop)
    return True


async def run_prelaunched(stub: PluginStub, stop: asyncio.Event, *, fd: int) -> bool:
    """Serve the inherited socket until the runtime closes it (or ``stop``); no reconnecting.

    False when the inherited socket could not be used at all."""
    try:
        sock = socket.socket(fileno=fd)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
    except OSError as exc:
        log.error("inherited_socket_unusable", fd=fd, variable=ENV_SOCKET, error=str(exc))
        stop.set()
        return False
    reason = await serve_until_stopped(stub, reader, writer, stop)
    log.info("runtime_connection_ended", reason=reason)
    stop.set()
    return True


def _hint(exc: OSError) -> str:
    """What to check when the runtime's socket cannot be opened."""
    if not isinstance(exc, PermissionError):
        return ("is containerd >= 1.7 running with NRI enabled "
                "([plugins.\"io.containerd.nri.v1.nri\"] disable = false) and its "
                "socket_path set to this path?")
    # The socket is there and refuses this process: NRI is on.
    if os.geteuid() != 0:
        return "the runtime's NRI socket is root's: run nri-qos as root"
    return ("the runtime's NRI socket refuses this process although it runs as root: it "
            "lacks CAP_DAC_OVERRIDE, or a security module (SELinux, AppArmor) denies it")
