"""The one asyncio layer of the protocol: a ttrpc server and a ttrpc client over NRI's mux.

One :class:`TtrpcPeer` owns one socket. A single reader task feeds the sans-IO
:class:`~nri_plugin.mux.Demultiplexer`. Every message goes out in one write of the transport,
already split by :func:`~nri_plugin.mux.encode_message`, so two messages never interleave. The
peer serves ttrpc requests on one logical connection and makes calls on the other, so the same
class is the plugin (serves conn 1, calls conn 2) and the simulated runtime (serves conn 2,
calls conn 1).

A handler that can answer at once does so from the reader, in the same turn of the event loop
that read the request; only a handler that has to wait gets a task. On a loaded node a turn of
the loop costs tens of microseconds (it runs with cold caches after the wake-up), which the
runtime would otherwise wait for on every CreateContainer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import structlog

from nri_plugin.envelope import (
    EnvelopeError,
    RpcError,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from nri_plugin.errors import MessageTooLarge, ProtocolError, StreamIdsExhausted
from nri_plugin.mux import Demultiplexer, encode_message
from nri_plugin.ttrpc import (
    ClientStreams,
    Frame,
    MessageType,
    ServerStreams,
    StatusCode,
    encode_frame,
)
from protos import ttrpc_envelope_pb2 as envelope

Handler = Callable[[envelope.Request], "bytes | Awaitable[bytes]"]
"""Serves one request: gets the decoded envelope, returns the serialized response message, at
once or as an awaitable (awaited in a task of its own). Raising :class:`RpcError` answers with
that status; any other exception answers UNKNOWN."""

READ_SIZE = 256 << 10

log = structlog.get_logger("nri_qos.transport")


class CallTimedOut(RpcError):
    """No answer came within the call's timeout (a local verdict, unlike an error status the
    peer sent, even one with the same code)."""


class ConnectionClosed(Exception):
    """The connection is gone; pending and later calls fail with this."""


class TtrpcPeer:
    """Both ttrpc roles on one NRI mux connection.

    ``serve_conn`` is the logical connection whose requests this side answers through
    ``handlers`` (keyed by ``(service, method)``); ``call_conn`` carries this side's calls.
    Run :meth:`run` as a task; it returns when the connection ends, after failing every pending
    call and cancelling every running handler. :attr:`end_reason` says why it ended.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        serve_conn: int,
        call_conn: int,
        handlers: Mapping[tuple[str, str], Handler],
    ) -> None:
        if serve_conn == call_conn:
            raise ValueError("serve_conn and call_conn must differ")
        self._reader = reader
        self._writer = writer
        self._serve_conn = serve_conn
        self._call_conn = call_conn
        self._handlers = dict(handlers)
        self._services = frozenset(service for service, _ in self._handlers)
        self._demux = Demultiplexer()
        self._server_streams = ServerStreams()
        self._client_streams = ClientStreams()
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        # Handlers that have to wait run as tasks of this group, which lives as long as run().
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.end_reason = ""

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending_calls(self) -> int:
        return len(self._pending)

    # -- reading ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Read and dispatch until EOF, a protocol error or :meth:`close`."""
        reason = "connection closed by peer"
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                try:
                    reason = await self._read_until_end()
                finally:
                    self._end(reason)
        finally:
            self._group = None
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()

    async def _read_until_end(self) -> str:
        """Feed the demultiplexer until the connection ends; why it ended."""
        try:
            while True:
                data = await self._reader.read(READ_SIZE)
                if not data:
                    if self._closed:
                        return self.end_reason or "closed locally"
                    return "connection closed by peer"
                for conn_id, frame in self._demux.feed(data):
                    if conn_id == self._serve_conn:
                        self._on_serve_frame(frame)
                    elif conn_id == self._call_conn:
                        self._on_call_frame(frame)
        except ProtocolError as exc:
            log.warning("protocol_error", error=str(exc))
            return f"protocol error: {exc}"
        except OSError as exc:
            return f"socket error: {exc}"

    def _on_serve_frame(self, frame: Frame) -> None:
        if frame.type != MessageType.REQUEST:
            # Unknown types are ignored for forward compatibility, as the Go server does.
            log.debug("ignored_frame", stream_id=frame.stream_id, type=frame.type)
            return
        stream_id = frame.stream_id
        rejection = self._server_streams.rejection_message(stream_id)
        if rejection is not None:
            self._answer(stream_id, b"", StatusCode.INVALID_ARGUMENT, rejection)
            return
        self._server_streams.accept(stream_id)
        try:
            request = decode_request(frame.data)
        except EnvelopeError as exc:
            self._answer(stream_id, b"", StatusCode.INVALID_ARGUMENT, str(exc))
            return
        handler = self._handlers.get((request.service, request.method))
        if handler is None:
            if request.service in self._services:
                message = f"method {request.method}"
            else:
                message = f"service {request.service}"
            self._answer(stream_id, b"", StatusCode.UNIMPLEMENTED, message)
            return
        try:
            result = handler(request)
        except (Exception, asyncio.CancelledError) as exc:
            # Raised by the handler's own code (the reader is not at an await here), so it is
            # the handler failing; letting it through would end the reader and the connection.
            self._answer(stream_id, b"", *_failure(exc, request.method))
            return
        if isinstance(result, bytes):
            self._answer(stream_id, result, StatusCode.OK, "")
        else:
            self._spawn(self._answer_when_done(stream_id, request.method, result))

    def _on_call_frame(self, frame: Frame) -> None:
        future = self._pending.pop(frame.stream_id, None)
        self._client_streams.close(frame.stream_id)
        if future is None or future.done():
            log.debug("dropped_response", stream_id=frame.stream_id)
            return
        if frame.type != MessageType.RESPONSE:
            future.set_exception(
                RpcError(StatusCode.INTERNAL, f"unexpected frame type {frame.type} for a call")
            )
            return
        try:
            reply = decode_response(frame.data)
        except EnvelopeError as exc:
            future.set_exception(RpcError(StatusCode.INTERNAL, str(exc)))
            return
        if reply.ok:
            future.set_result(reply.payload)
        else:
            future.set_exception(RpcError(reply.code, reply.message))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        if self._group is None:
            coro.close()
            return
        task = self._group.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- serving ---------------------------------------------------------------------------

    async def _answer_when_done(self, stream_id: int, method: str,
                                pending: Awaitable[bytes]) -> None:
        try:
            payload = await pending
        except Exception as exc:
            self._answer(stream_id, b"", *_failure(exc, method))
        else:
            self._answer(stream_id, payload, StatusCode.OK, "")

    def _answer(self, stream_id: int, payload: bytes, code: int, message: str) -> None:
        try:
            frame = encode_frame(
                stream_id, MessageType.RESPONSE, encode_response(payload, code, message)
            )
        except MessageTooLarge as exc:
            frame = encode_frame(
                stream_id,
                MessageType.RESPONSE,
                encode_response(b"", StatusCode.RESOURCE_EXHAUSTED, str(exc)),
            )
        except Exception:
            # An answer that cannot be encoded (e.g. a status text that is not valid UTF-8)
            # still gets an answer: silence would cost the runtime its whole request timeout.
            log.exception("answer_unencodable", stream_id=stream_id)
            frame = encode_frame(
                stream_id,
                MessageType.RESPONSE,
                encode_response(b"", StatusCode.INTERNAL, "answer could not be encoded"),
            )
        # Answers are small and the runtime reads them as they come: no waiting for the
        # buffer to drain (a gone connection drops the answer; the reader ends the peer).
        with contextlib.suppress(ConnectionClosed):
            self._send(self._serve_conn, frame)

    # -- calling ---------------------------------------------------------------------------

    async def call(
        self, service: str, method: str, payload: bytes, *, timeout_s: float
    ) -> bytes:
        """Call ``service/method`` on the peer; the response message's bytes.

        Raises :class:`RpcError` for a non-OK status, a local refusal (over 4 MiB:
        RESOURCE_EXHAUSTED) or no answer within ``timeout_s`` seconds (DEADLINE_EXCEEDED), and
        :class:`ConnectionClosed` when the connection ends first.
        """
        if self._closed:
            raise ConnectionClosed(self.end_reason or "connection closed")
        try:
            stream_id = self._client_streams.open()
        except StreamIdsExhausted as exc:
            raise ConnectionClosed(str(exc)) from exc
        try:
            frame = encode_frame(
                stream_id,
                MessageType.REQUEST,
                encode_request(service, method, payload, int(timeout_s * 1e9)),
            )
        except MessageTooLarge as exc:
            self._client_streams.close(stream_id)
            raise RpcError(StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        try:
            await self._write(self._call_conn, frame)
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError as exc:
            raise CallTimedOut(
                StatusCode.DEADLINE_EXCEEDED, f"{method}: no answer within {timeout_s:g} s"
            ) from exc
        finally:
            if self._pending.pop(stream_id, None) is not None:
                self._client_streams.close(stream_id)

    # -- writing and closing ---------------------------------------------------------------

    def _send(self, conn_id: int, frame: bytes) -> None:
        """Hand one whole message to the transport (one write, so nothing gets in between)."""
        data = encode_message(conn_id, frame)
        if self._closed:
            raise ConnectionClosed(self.end_reason or "connection closed")
        try:
            self._writer.write(data)
        except (ConnectionError, OSError) as exc:
            raise ConnectionClosed(f"write failed: {exc}") from exc

    async def _write(self, conn_id: int, frame: bytes) -> None:
        """:meth:`_send`, then wait while the transport's buffer is over its high-water mark."""
        self._send(conn_id, frame)
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            raise ConnectionClosed(f"write failed: {exc}") from exc

    def close(self, reason: str = "closed locally") -> None:
        """End the connection; :meth:`run` then returns."""
        if not self._closed:
            self._closed = True
            self.end_reason = reason
            self._writer.close()

    def _end(self, reason: str) -> None:
        """Close, fail every pending call and cancel every running handler (the task group
        then waits for them)."""
        self.close(reason)
        if not self.end_reason:
            self.end_reason = reason
        error = ConnectionClosed(self.end_reason)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        for task in self._tasks:
            task.cancel()


def _failure(exc: BaseException, method: str) -> tuple[int, str]:
    """The status answering a handler that raised ``exc``."""
    if isinstance(exc, RpcError):
        return exc.code, exc.message
    # Nothing a handler raises may reach the wire as anything but a status, nor end the
    # reader: not even a log stream that fails.
    with contextlib.suppress(OSError, ValueError):
        log.exception("handler_failed", method=method, exc_info=exc)
    return StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}"
