"""The runtime's end of an NRI connection, spoken frame by frame, and a real agent to speak to.

:class:`RawRuntime` writes whatever bytes it is told to, well-formed or not, and reads the
agent's frames with the sans-IO decoders: it plays runtimes that misbehave, where
:class:`~nri_plugin.sim.simulator.RuntimeSimulator` plays one that behaves. :func:`running_agent`
starts ``nri-qos run`` as a child process connected to a socket this process listens on, as a
runtime's would be. The tests and ``bench/hostile_runtime.py`` use both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from common.audit import MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from nri_plugin.session.stub import PluginStub
from nri_plugin.wire.envelope import (
    Reply,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from nri_plugin.wire.mux import (
    PLUGIN_SERVICE_CONN,
    RUNTIME_SERVICE_CONN,
    Demultiplexer,
    encode_message,
)
from nri_plugin.wire.nri_api import PLUGIN_SERVICE
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.ttrpc import Frame, MessageType, encode_frame
from protos import nri_api_pb2 as api
from tests.support.paths import REPO

MiB = 1 << 20
ANSWER_S = 5.0
"""How long an answer the agent owes may take before the wait counts as a hang."""
BOUND_S = 3.0
"""Bound of a wait for something the agent owes within a short handshake deadline (generous
for a loaded machine)."""
KEPT_ANSWERS = 1024
"""Answers to other requests :meth:`RawRuntime.answer` puts aside while it waits for one."""


def mux_frame(conn_id: int, payload: bytes) -> bytes:
    """One mux frame around any bytes (not necessarily one whole ttrpc frame)."""
    return conn_id.to_bytes(4, "big") + len(payload).to_bytes(4, "big") + payload


def configure_request(registration_timeout_ms: int = 5000, runtime_name: str = "containerd",
                      request_timeout_ms: int = 2000) -> bytes:
    return api.ConfigureRequest(
        runtime_name=runtime_name, runtime_version="v2.1.0", NRI_version="v0.12.0",
        registration_timeout=registration_timeout_ms, request_timeout=request_timeout_ms,
    ).SerializeToString()


def pod_message(uid: str, *, annotations: dict[str, str] | None = None, name: str = "",
                labels: dict[str, str] | None = None) -> api.PodSandbox:
    pod = api.PodSandbox(id=f"sb-{uid}", uid=uid, name=name or f"pod-{uid}", namespace="ns",
                         annotations=annotations or {}, labels=labels or {})
    pod.linux.cgroup_parent = f"/kubepods/besteffort/pod{uid}"
    return pod


def container_message(uid: str, name: str = "c") -> api.Container:
    container = api.Container(id=f"{name}-{uid}", pod_sandbox_id=f"sb-{uid}", name=name)
    container.linux.resources.memory.limit.value = 256 * MiB
    return container


def create_request(uid: str) -> bytes:
    return api.CreateContainerRequest(pod=pod_message(uid),
                                      container=container_message(uid)).SerializeToString()


class RawRuntime:
    """One plugin connection as the runtime sees it, at the level of frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.demux = Demultiplexer()
        self.frames: deque[tuple[int, Frame]] = deque()
        self.unclaimed: dict[int, Frame] = {}
        self.next_stream = 1

    def write(self, data: bytes | memoryview) -> None:
        self.writer.write(data)

    async def flush(self, seconds: float = ANSWER_S) -> None:
        async with asyncio.timeout(seconds):
            await self.writer.drain()

    async def frame(self, seconds: float = ANSWER_S) -> tuple[int, Frame]:
        """The agent's next frame; EOFError once it closed the connection."""
        async with asyncio.timeout(seconds):
            while not self.frames:
                data = await self.reader.read(MiB)
                if not data:
                    raise EOFError("the agent closed the connection")
                self.frames.extend(self.demux.feed(data))
        return self.frames.popleft()

    async def closed_within(self, seconds: float) -> bool:
        """True once the agent closed the connection (what it still sent is discarded)."""
        try:
            async with asyncio.timeout(seconds):
                while await self.reader.read(MiB):
                    pass
        except TimeoutError:
            return False
        except OSError:
            pass
        return True

    def stream(self) -> int:
        """The next odd stream id of this runtime's requests."""
        stream_id, self.next_stream = self.next_stream, self.next_stream + 2
        return stream_id

    @staticmethod
    def request_bytes(method: str, payload: bytes, stream_id: int,
                      service: str = PLUGIN_SERVICE) -> bytes:
        return encode_message(PLUGIN_SERVICE_CONN, encode_frame(
            stream_id, MessageType.REQUEST,
            encode_request(service, method, payload, 2_000_000_000)))

    def send(self, method: str, payload: bytes, *, service: str = PLUGIN_SERVICE) -> int:
        """Write one request; its stream id."""
        stream_id = self.stream()
        self.write(self.request_bytes(method, payload, stream_id, service))
        return stream_id

    async def answer(self, stream_id: int, seconds: float = ANSWER_S) -> Reply:
        """The agent's answer on ``stream_id``. Answers to other requests that come first are
        put aside for their own turn (the latest :data:`KEPT_ANSWERS`); other frames dropped."""
        while True:
            kept = self.unclaimed.pop(stream_id, None)
            if kept is not None:
                return decode_response(kept.data)
            conn, frame = await self.frame(seconds)
            if conn != PLUGIN_SERVICE_CONN:
                continue
            if frame.stream_id == stream_id:
                return decode_response(frame.data)
            self.unclaimed[frame.stream_id] = frame
            if len(self.unclaimed) > KEPT_ANSWERS:
                del self.unclaimed[next(iter(self.unclaimed))]

    async def call(self, method: str, payload: bytes, seconds: float = ANSWER_S) -> Reply:
        return await self.answer(self.send(method, payload), seconds)

    async def register(self, *, error: str | None = None) -> None:
        """Wait for RegisterPlugin and answer it (with an error status if ``error``)."""
        conn, frame = await self.frame()
        method = decode_request(frame.data).method
        if conn != RUNTIME_SERVICE_CONN or method != "RegisterPlugin":
            raise AssertionError(f"expected RegisterPlugin, got {method} on connection {conn}")
        answer = (encode_response() if error is None
                  else encode_response(b"", StatusCode.UNKNOWN, error))
        self.write(encode_message(RUNTIME_SERVICE_CONN, encode_frame(
            frame.stream_id, MessageType.RESPONSE, answer)))

    async def handshake(self, registration_timeout_ms: int = 5000) -> None:
        """RegisterPlugin, Configure and an empty Synchronize, each of them answered OK."""
        await self.register()
        for method, payload in (("Configure", configure_request(registration_timeout_ms)),
                                ("Synchronize", b"")):
            reply = await self.call(method, payload)
            if not reply.ok:
                raise AssertionError(f"{method} refused: {reply.message}")

    async def create_container_ok(self, uid: str = "alive") -> bool:
        return (await self.call("CreateContainer", create_request(uid))).ok

    def close(self) -> None:
        self.writer.close()


def status_kib(pid: int, name: str) -> int:
    """A memory figure of /proc/PID/status (VmRSS, VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


def reset_peak(pid: int) -> None:
    """Make VmHWM start again from the current RSS (Linux; ignored where refused)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return


@dataclass
class Agent:
    """An ``nri-qos run`` child process and the connections it made to the runtime socket."""

    pid: int
    log_path: Path
    connections: asyncio.Queue[RawRuntime] = field(default_factory=asyncio.Queue)

    async def accept(self, seconds: float = 30.0) -> RawRuntime:
        async with asyncio.timeout(seconds):
            return await self.connections.get()


@asynccontextmanager
async def running_agent(directory: Path, config: str, *,
                        source: Path = REPO) -> AsyncIterator[Agent]:
    """``nri-qos run`` from ``source`` with ``config``, connecting to a socket in ``directory``;
    its log goes to ``directory/agent.log``."""
    socket_path = directory / "nri.sock"
    config_path = directory / "config.toml"
    config_path.write_text(config)
    log_path = directory / "agent.log"
    queue: asyncio.Queue[RawRuntime] = asyncio.Queue()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await queue.put(RawRuntime(reader, writer))

    server = await asyncio.start_unix_server(accepted, path=str(socket_path), limit=8 * MiB)
    log_file: IO[bytes]
    with log_path.open("wb") as log_file:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "nri_plugin", "run", "--config", str(config_path),
            "--socket", str(socket_path), "--log-level", "info",
            cwd=source, stderr=log_file, stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(source)},
        )
        try:
            yield Agent(child.pid, log_path, queue)
        finally:
            if child.returncode is None:
                child.terminate()
            await child.wait()
            server.close()
            await server.wait_closed()
            while not queue.empty():
                queue.get_nowait().close()


def plugin_config(**plugin: Any) -> Config:
    """The default configuration with these ``[plugin]`` settings."""
    cfg = Config()
    return dataclasses.replace(cfg, plugin=dataclasses.replace(cfg.plugin, **plugin))


async def socket_pair(limit: int = 8 * MiB) -> tuple[
        asyncio.StreamReader, asyncio.StreamWriter, RawRuntime]:
    """The agent's end (reader, writer) and the runtime's end of a connected unix socket."""
    a, b = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=a)
    rb, wb = await asyncio.open_unix_connection(sock=b, limit=limit)
    return reader, writer, RawRuntime(rb, wb)


@dataclass
class Session:
    """A stub serving the agent's end of a socket pair; the test plays the runtime."""

    stub: PluginStub
    runtime: RawRuntime
    serving: asyncio.Task[str]
    sink: MemoryAuditSink
    state: NodeState

    async def ended(self) -> str:
        """Why the agent ended the connection; it must within :data:`BOUND_S`."""
        async with asyncio.timeout(BOUND_S):
            return await self.serving

    def rejections(self) -> dict[str, int]:
        return {kind: n for kind, n in self.stub.rejections.as_dict().items() if n}
