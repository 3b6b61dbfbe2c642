"""What the running agent tells ``nri-qos status``, and the local socket it tells it on.

:func:`status_document` assembles one JSON-ready object from the agent's parts (the NRI session,
the node state, the reconciler's loops, the detection board, the features and why each one that
does not run is off). :class:`StatusServer` listens on a unix socket that only root can use (the
socket is 0600, in a directory the server creates 0700) and writes the document to whoever
connects, then closes. The document carries ``format`` (:data:`STATUS_FORMAT`); readers must
ignore keys they do not know.

``agent.config_refused`` lists the errors of the configuration files' latest version while it
is refused and an older configuration is in force (empty otherwise).
``agent.restart_needed`` maps each key the agent reads at start only and the files set otherwise
to its value in force and the new one (``in_force``, ``new``): empty unless a reload changed one.

The sections ``mitigation``, ``evictions`` and ``taints`` come from providers handed in
:attr:`StatusSources.sections` (:func:`ladder_sections` builds them; ``None`` in the document
when the agent has none, as without the background half): the ladder a mapping (``level``,
``cause``, ``engaged``, ``releasing`` (rungs whose release is not confirmed yet, retried),
``last`` step per rung), evictions and taints a list of mappings, newest
first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from common.state import NodeState
from hooks.events import Event
from hooks.untrusted import bounded
from nri_plugin.config.schema import Config
from nri_plugin.report.features import Feature, evaluate, kubernetes_feature
from nri_plugin.report.local_server import Clients
from nri_plugin.session.stub import PluginStub
from nri_plugin.version import agent_version
from reconciler.detection.signals import Board
from reconciler.eviction.manager import EvictionManager
from reconciler.host.probe import HostInfo
from reconciler.loops.base import LoopTracker
from reconciler.mitigation.service import Mitigation

STATUS_FORMAT = 1
EXTENSION_SECTIONS = ("mitigation", "evictions", "taints")
"""Sections other subsystems provide; None in the document when no provider is registered."""
KUBELET_WAIT = ("kubelet's pods cgroup (kubepods.slice or kubepods): cgroup_driver is auto and "
                "kubelet has not made it yet")
"""Why the reconciler's parts wait, in ``reconciler.waiting_for``."""
WRITE_TIMEOUT_S = 5.0

log = structlog.get_logger("nri_qos.status")


@dataclass(frozen=True, slots=True)
class StatusSources:
    """The agent parts the status document is read from."""

    stub: PluginStub
    state: NodeState
    tracker: LoopTracker
    board: Board
    config: Callable[[], Config]
    config_source: Callable[[], str]
    # The host as last probed (probed again once kubelet's pods cgroup is there).
    host: Callable[[], HostInfo]
    # Whether the reconciler got a Kubernetes API client (None: not started, or not running).
    kubernetes: bool | None
    reconciler_running: bool
    wall_clock: Callable[[], float]
    # When the agent started, by ``wall_clock``.
    started_unix: float
    sections: Mapping[str, Callable[[], Any]] = field(default_factory=dict)
    # The start-only keys the files set otherwise: key -> (value in force, value in the files).
    restart_needed: Callable[[], Mapping[str, tuple[Any, Any]]] = dict
    # The errors of the configuration files' latest version, refused (empty: in force).
    config_refused: Callable[[], Sequence[str]] = tuple


def status_document(src: StatusSources) -> dict[str, Any]:
    """The agent's status now; called from the event loop."""
    now = asyncio.get_running_loop().time()
    wall = src.wall_clock()
    cfg = src.config()
    stub = src.stub
    age = stub.state_age_s()
    snapshot = src.state.snapshot()
    levels: dict[str, int] = {}
    for view in snapshot.pods.values():
        levels[view.level] = levels.get(view.level, 0) + 1
    kubernetes = kubernetes_feature(cfg, src.kubernetes, "API client in use")
    host = src.host()
    features = evaluate(cfg, host, kubernetes)
    # Started before kubelet with the driver to detect: the cgroup parts wait for its cgroup.
    waiting = src.reconciler_running and host.cgroup.awaiting_kubelet
    running = src.reconciler_running and not waiting
    if not running:
        why = KUBELET_WAIT if waiting else "the reconciler does not run"
        for name, feature in features.items():
            if name.startswith("reconciler.") and feature.runs:
                features[name] = Feature(False, why)
    if not src.reconciler_running and cfg.kubernetes.enabled:
        features["kubernetes"] = Feature(
            False, "not used: the reconciler, which holds the API client, does not run")
    runtime = stub.terms.runtime
    loops = {
        name: {"ago_s": round(now - record.started, 3),
               "duration_ms": round(record.duration_s * 1000, 3),
               "failed": record.failed, "cycles": record.cycles, "failures": record.failures,
               "last_error": record.error or None}
        for name, record in sorted(src.tracker.last().items())
    }
    document: dict[str, Any] = {
        "format": STATUS_FORMAT,
        "agent": {"version": agent_version(), "pid": os.getpid(),
                  "uptime_s": round(wall - src.started_unix, 3),
                  "plugin": f"{stub.identity.index}-{stub.identity.name}",
                  "config": src.config_source(), "mode": src.config().agent.mode,
                  "restart_needed": {key: {"in_force": held, "new": new}
                                     for key, (held, new) in src.restart_needed().items()},
                  "config_refused": list(src.config_refused())},
        "connection": {"state": stub.connection_state, "for_s": round(age, 3),
                       "since_unix": round(wall - age, 3), "connections": stub.connections},
        "runtime": None if stub.connection_state == "disconnected" or not runtime.name else {
            "name": bounded(runtime.name), "version": bounded(runtime.version),
            "nri_version": stub.nri_version_text,
            "request_timeout_ms": stub.terms.request_timeout_ms,
            "event_mask": f"{stub.event_mask:#x}",
            "events": [e.name.lower() for e in Event if stub.event_mask & e.bit],
        },
        "features": {name: {"runs": f.runs, "detail": f.detail} for name, f in features.items()},
        "node": {"pods": len(snapshot.pods), "containers": len(snapshot.containers),
                 "running_containers": len(snapshot.running()),
                 "pods_by_level": dict(sorted(levels.items())),
                 "synchronized": src.state.synced},
        "reconciler": {"running": running, "waiting_for": KUBELET_WAIT if waiting else None,
                       "loops": loops},
        "detection": [
            {"detector": r.detector, "scope": r.scope, "level": r.level.name.lower(),
             "value": r.value, "threshold": r.threshold, "unit": r.unit,
             "reason": r.reason or None, "ago_s": round(now - r.at, 3) if r.at else None}
            for r in sorted(src.board.current(), key=lambda r: r.key)
        ],
    }
    for name in EXTENSION_SECTIONS:
        provider = src.sections.get(name)
        document[name] = None if provider is None else provider()
    return document


def ladder_sections(mitigation: Mitigation,
                    evictor: EvictionManager) -> dict[str, Callable[[], Any]]:
    """The providers of the ``mitigation``, ``evictions`` and ``taints`` sections."""

    def ladder() -> dict[str, Any]:
        state = mitigation.state()
        return {"level": state.level.name.lower(), "cause": state.cause,
                "engaged": list(state.engaged), "releasing": list(state.releasing),
                "last": {rung: {"step": step, "result": result, "detail": bounded(detail)}
                         for rung, (step, result, detail) in sorted(state.last.items())}}

    def evictions() -> list[dict[str, Any]]:
        return [{"pod": r.pod, "plugin": r.plugin, "outcome": str(r.outcome),
                 "reason": bounded(r.reason), "ago_s": round(age, 3)}
                for age, r in evictor.recent()]

    def taints() -> list[dict[str, Any]]:
        now = asyncio.get_running_loop().time()
        return [{"key": t.key, "value": t.value, "effect": t.effect,
                 "for_s": round(now - t.since, 3)} for t in mitigation.taints()]

    return {"mitigation": ladder, "evictions": evictions, "taints": taints}


class AgentAlreadyServing(Exception):
    """Another process answers on the status socket."""


class StatusServer:
    """Writes ``document()`` as one JSON line to each client of the unix socket at ``path``."""

    def __init__(self, path: str, document: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self._document = document
        self._clients = Clients()

    async def serve(self, stop: asyncio.Event) -> None:
        try:
            sock = await self._bind()
        except (OSError, AgentAlreadyServing) as exc:
            # Status is for people; the agent goes on without it, loudly.
            log.error("status_unavailable", path=self.path, error=str(exc))
            await stop.wait()
            return
        server = await asyncio.start_unix_server(self._handle, sock=sock)
        inode = os.stat(self.path).st_ino
        log.info("status_serving", path=self.path)
        try:
            await self._clients.serve_until(server, stop)
        finally:
            # Only our own socket: a successor may already have bound a new one.
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == inode:
                    os.unlink(self.path)

    async def _bind(self) -> socket.socket:
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, mode=0o700, exist_ok=True)
        try:
            existing = os.lstat(self.path)
        except FileNotFoundError:
            existing = None
        if existing is not None:
            if not stat.S_ISSOCK(existing.st_mode):
                raise AgentAlreadyServing(f"{self.path} exists and is not a socket; not touched")
            if await another_agent_answers(self.path):
                raise AgentAlreadyServing(f"another agent answers on {self.path}")
            os.unlink(self.path)  # left behind by an agent that did not stop cleanly
        # Bound under a temporary name, made 0600, then renamed: the socket is never reachable
        # with wider permissions, whatever the umask or the directory's mode.
        temporary = os.path.join(directory, f".status-{os.getpid()}.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(temporary)
            os.chmod(temporary, 0o600)
            os.rename(temporary, self.path)
            sock.listen(8)
            sock.setblocking(False)
        except OSError:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        return sock

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with self._clients.answering(writer):
            try:
                body = json.dumps(self._document(), sort_keys=True).encode() + b"\n"
            except Exception:
                log.exception("status_failed")
                body = json.dumps({"format": STATUS_FORMAT,
                                   "error": "the agent failed to assemble its status; see its "
                                            "log"}).encode() + b"\n"
            writer.write(body)
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await writer.drain()


async def another_agent_answers(path: str) -> bool:
    """Whether a process answers on the status socket ``path`` (an agent running)."""
    try:
        async with asyncio.timeout(1.0):
            _, writer = await asyncio.open_unix_connection(path)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    return True
