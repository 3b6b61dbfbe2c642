"""The one asyncio layer of the protocol: a ttrpc server and a ttrpc client over NRI's mux.

One :class:`TtrpcPeer` owns one socket. A single reader task feeds the sans-IO
:class:`~nri_plugin.wire.mux.Demultiplexer`. Every message goes out in one write of the transport,
already split by :func:`~nri_plugin.wire.mux.encode_message`, so two messages never interleave. The
peer serves ttrpc requests on one logical connection and makes calls on the other, so the same
class is the plugin (serves conn 1, calls conn 2) and the simulated runtime (serves conn 2,
calls conn 1).

A handler that can answer at once does so from the reader, in the same turn of the event loop
that read the request; only a handler that has to wait gets a task. On a loaded node a turn of
the loop costs tens of microseconds (it runs with cold caches after the wake-up), which the
runtime would otherwise wait for on every CreateContainer.

The other end is not trusted to behave. Memory stays bounded: the reader holds at most one
partial frame per logical connection, skips oversized frames without keeping them (answering
that stream RESOURCE_EXHAUSTED, as the Go server does), and stops reading while the peer leaves
its answers unread or too many handlers wait (backpressure, not a queue). Waits end: the rest of
a frame that has begun must come within :attr:`TtrpcPeer.stall_timeout_s`, and a peer that does
not take its answers within it is dropped. Every refusal is counted and logged once per kind
(:mod:`nri_plugin.wire.rejections`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import structlog

from hooks.untrusted import bounded
from nri_plugin.wire.calls import PendingCalls
from nri_plugin.wire.envelope import decode_request, encode_response
from nri_plugin.wire.errors import (
    CallTimedOut,
    ConnectionClosed,
    EnvelopeError,
    MessageTooLarge,
    ProtocolError,
    RpcError,
    StreamIdsExhausted,
)
from nri_plugin.wire.mux import Demultiplexer, encode_message
from nri_plugin.wire.rejections import ConnectionRejections, Rejection, RejectionCounts
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.ttrpc import Frame, MessageType, ServerStreams, encode_frame, oversized_message
from protos import ttrpc_envelope_pb2 as envelope

Handler = Callable[[envelope.Request], "bytes | Awaitable[bytes]"]
"""Serves one request: gets the decoded envelope, returns the serialized response message, at
once or as an awaitable (awaited in a task of its own). Raising :class:`RpcError` answers with
that status; any other exception answers UNKNOWN."""

READ_SIZE = 256 << 10
MAX_HANDLERS_IN_FLIGHT = 64
"""Requests of one connection whose handlers are still running before the reader stops taking
more. containerd sends a plugin one request at a time (its validators aside), so a runtime with
more in flight has gone wrong; each one holds its request until it is answered."""
MAX_UNSENT_BYTES = 1 << 20
"""Answer bytes the peer has not taken yet before the reader stops reading its requests (checked
after each read, so the answers to one read may come on top). The runtime reads answers as they
come (an answer is a few hundred bytes), so a MiB unread means it stopped reading; without this
limit every request it keeps sending would queue another answer."""
DEFAULT_STALL_TIMEOUT_S = 5.0
"""How long the rest of a frame that has begun, or room for more answers, may take: the runtime's
default registration timeout, until the session knows the runtime's own."""
STATUS_TEXT_CHARS = 1024
"""Characters of an exception's text sent back in an error status."""

log = structlog.get_logger("nri_qos.transport")


class TtrpcPeer:
    """Both ttrpc roles on one NRI mux connection.

    ``serve_conn`` is the logical connection whose requests this side answers through
    ``handlers`` (keyed by ``(service, method)``); ``call_conn`` carries this side's calls.
    Run :meth:`run` as a task; it returns when the connection ends, after failing every pending
    call and cancelling every running handler. :attr:`end_reason` says why it ended.
    """

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
        serve_conn: int,
        call_conn: int,
        handlers: Mapping[tuple[str, str], Handler],
        rejections: RejectionCounts | None = None,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        max_in_flight: int = MAX_HANDLERS_IN_FLIGHT,
        max_unsent_bytes: int = MAX_UNSENT_BYTES,
    ) -> None:
        if serve_conn == call_conn:
            raise ValueError("serve_conn and call_conn must differ")
        self._reader = reader
        self._writer = writer
        self._transport = writer.transport
        # The transport pauses (and drain() waits) above this many unsent bytes.
        self._transport.set_write_buffer_limits(high=max_unsent_bytes)
        self._max_unsent = max_unsent_bytes
        self._max_in_flight = max_in_flight
        self.stall_timeout_s = stall_timeout_s
        self.rejections = ConnectionRejections(rejections)
        # When the frame that has begun must be complete (loop time); None between frames.
        self._frame_deadline: float | None = None
        self._dropped_seen = 0
        self._serve_conn = serve_conn
        self._call_conn = call_conn
        self._handlers = dict(handlers)
        self._services = frozenset(service for service, _ in self._handlers)
        self._demux = Demultiplexer()
        self._server_streams = ServerStreams()
        self._calls = PendingCalls(self.rejections)
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
        return len(self._calls)

    @property
    def unsent_bytes(self) -> int:
        """Bytes written but not yet taken by the peer."""
        return int(self._transport.get_write_buffer_size())

    # -- reading ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Read and dispatch until EOF, a protocol error, a stall or :meth:`close`."""
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
            self.rejections.summarize()
            await _wait_closed(self._writer, self.stall_timeout_s)

    async def _read_until_end(self) -> str:
        """Feed the demultiplexer until the connection ends; why it ended."""
        loop = asyncio.get_running_loop()
        try:
            # The bytes read are handed straight on, never kept in a local across the next
            # wait: a large request's memory goes as soon as it is handled.
            while self._dispatch(await _read(self._reader, self._frame_deadline,
                                             self.stall_timeout_s), loop):
                if self._closed:
                    return self.end_reason
                if self._behind():
                    stalled = await self._wait_for_room()
                    if stalled is not None:
                        return stalled
            if self._closed:
                return self.end_reason or "closed locally"
            return "connection closed by peer"
        except ProtocolError as exc:
            self.rejections(Rejection.LOST_FRAMING, str(exc))
            log.warning("protocol_error", error=str(exc))
            return f"protocol error: {exc}"
        except _Stalled as exc:
            self.rejections(Rejection.STALLED, str(exc))
            log.warning("connection_stalled", error=str(exc), timeout_s=self.stall_timeout_s)
            # What the peer did not take in time, it will not take: dropped with the socket.
            self._transport.abort()
            return f"stalled: {exc}"
        except OSError as exc:
            return f"socket error: {exc}"

    def _dispatch(self, data: bytes, loop: asyncio.AbstractEventLoop) -> bool:
        """Handle the frames ``data`` completes; False at EOF."""
        if not data:
            return False
        demux = self._demux
        frames = demux.feed(data)
        for conn_id, frame in frames:
            if self._closed:
                # Closed by a handler (e.g. a session that cannot go on): the requests read
                # with it are not served.
                break
            if conn_id == self._serve_conn:
                self._on_serve_frame(frame)
            elif conn_id == self._call_conn:
                self._calls.on_frame(frame)
        if demux.dropped_frames != self._dropped_seen:
            self.rejections(Rejection.UNKNOWN_CONNECTION, "mux frame for a connection other "
                            "than 1 and 2", demux.dropped_frames - self._dropped_seen)
            self._dropped_seen = demux.dropped_frames
        # The rest of a frame that has begun must come in time; every frame completed starts
        # the clock again, so a peer that keeps sending is never cut off.
        if not demux.in_frame:
            self._frame_deadline = None
        elif frames or self._frame_deadline is None:
            self._frame_deadline = loop.time() + self.stall_timeout_s
        return True

    def _behind(self) -> bool:
        return (len(self._tasks) >= self._max_in_flight
                or self._transport.get_write_buffer_size() > self._max_unsent)

    async def _wait_for_room(self) -> str | None:
        """Read nothing more until handlers finished and the peer took its answers; the reason
        to end the connection when that does not happen within the stall timeout."""
        try:
            async with asyncio.timeout(self.stall_timeout_s):
                while len(self._tasks) >= self._max_in_flight:
                    await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
                await self._writer.drain()
        except TimeoutError:
            raise _Stalled(
                f"{self.unsent_bytes} bytes of answers not taken and {len(self._tasks)} "
                f"requests in progress after {self.stall_timeout_s:g} s"
            ) from None
        except (ConnectionError, OSError) as exc:
            return f"socket error: {exc}"
        return None

    def _on_serve_frame(self, frame: Frame) -> None:
        stream_id = frame.stream_id
        if frame.oversized:
            # As the Go server: that stream gets an error, the connection goes on.
            message = oversized_message(frame.oversized)
            self.rejections(Rejection.OVERSIZED_FRAME, message, stream_id=stream_id)
            self._answer(stream_id, b"", StatusCode.RESOURCE_EXHAUSTED, message)
            return
        if frame.type != MessageType.REQUEST:
            # Unknown types are ignored for forward compatibility, as the Go server does.
            self.rejections(Rejection.UNKNOWN_FRAME_TYPE, f"frame of type {frame.type} where "
                            "requests are served", stream_id=stream_id)
            return
        rejection = self._server_streams.rejection_message(stream_id)
        if rejection is not None:
            self.rejections(Rejection.BAD_STREAM_ID, rejection)
            self._answer(stream_id, b"", StatusCode.INVALID_ARGUMENT, rejection)
            return
        self._server_streams.accept(stream_id)
        try:
            request = decode_request(frame.data)
        except EnvelopeError as exc:
            self.rejections(Rejection.BAD_ENVELOPE, str(exc), stream_id=stream_id)
            self._answer(stream_id, b"", StatusCode.INVALID_ARGUMENT, str(exc))
            return
        handler = self._handlers.get((request.service, request.method))
        if handler is None:
            # The status text is the Go server's.
            kind, message = _unimplemented(request, self._services)
            self.rejections(kind, message, stream_id=stream_id)
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
        except (Exception, asyncio.CancelledError) as exc:
            task = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and task and task.cancelling():
                raise  # this request's own task is cancelled: the connection is ending
            # Else the handler raised it (awaiting work cancelled elsewhere): answered, or the
            # runtime would wait out its timeout and drop the plugin.
            self._answer(stream_id, b"", *_failure(exc, method))
        else:
            self._answer(stream_id, payload, StatusCode.OK, "")

    def _answer(self, stream_id: int, payload: bytes, code: int, message: str) -> None:
        frame = _response_frame(stream_id, payload, code, message)
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
            stream_id, frame, future = self._calls.start(service, method, payload, timeout_s)
        except StreamIdsExhausted as exc:
            raise ConnectionClosed(str(exc)) from exc
        except MessageTooLarge as exc:
            raise RpcError(StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        try:
            async with asyncio.timeout(timeout_s):
                await self._write(self._call_conn, frame)
                return await future
        except TimeoutError as exc:
            raise CallTimedOut(
                StatusCode.DEADLINE_EXCEEDED, f"{method}: no answer within {timeout_s:g} s"
            ) from exc
        finally:
            self._calls.forget(stream_id)

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
            # The transport stops reading at once, but closes only once the peer took what was
            # written: the reader must not wait for that (run() bounds the wait).
            self._reader.feed_eof()

    def _end(self, reason: str) -> None:
        """Close, fail every pending call and cancel every running handler (the task group
        then waits for them)."""
        self.close(reason)
        if not self.end_reason:
            self.end_reason = reason
        self._calls.fail_all(ConnectionClosed(self.end_reason))
        for task in self._tasks:
            task.cancel()


async def _read(reader: asyncio.StreamReader, deadline: float | None,
                stall_timeout_s: float) -> bytes:
    """The next bytes ``reader`` has; when a frame has begun, they must come by ``deadline``
    (loop time)."""
    if deadline is None:
        return await reader.read(READ_SIZE)
    try:
        async with asyncio.timeout_at(deadline):
            return await reader.read(READ_SIZE)
    except TimeoutError:
        raise _Stalled(
            f"the rest of a frame did not come within {stall_timeout_s:g} s"
        ) from None


def _unimplemented(request: envelope.Request, services: frozenset[str]) -> tuple[Rejection, str]:
    """What a request no handler serves is refused as, and the status text saying so."""
    # The names are the peer's own, so bounded.
    if request.service in services:
        return Rejection.UNKNOWN_METHOD, f"method {bounded(request.method)}"
    return Rejection.UNKNOWN_SERVICE, f"service {bounded(request.service)}"


def _response_frame(stream_id: int, payload: bytes, code: int, message: str) -> bytes:
    """The response frame answering ``stream_id``; one that cannot be encoded as asked becomes
    an error status."""
    try:
        return encode_frame(
            stream_id, MessageType.RESPONSE, encode_response(payload, code, message)
        )
    except MessageTooLarge as exc:
        return encode_frame(
            stream_id,
            MessageType.RESPONSE,
            encode_response(b"", StatusCode.RESOURCE_EXHAUSTED, str(exc)),
        )
    except Exception:
        # An answer that cannot be encoded (e.g. a status text that is not valid UTF-8)
        # still gets an answer: silence would cost the runtime its whole request timeout.
        log.exception("answer_unencodable", stream_id=stream_id)
        return encode_frame(
            stream_id,
            MessageType.RESPONSE,
            encode_response(b"", StatusCode.INTERNAL, "answer could not be encoded"),
        )


async def _wait_closed(writer: asyncio.StreamWriter, timeout_s: float) -> None:
    """Let what was written go out, then the socket closes; a peer that does not take it within
    ``timeout_s`` gets it dropped (else the socket, and what it holds, would stay until the peer
    reads)."""
    try:
        async with asyncio.timeout(timeout_s):
            await writer.wait_closed()
    except TimeoutError:
        writer.transport.abort()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    except OSError:
        pass


def _failure(exc: BaseException, method: str) -> tuple[int, str]:
    """The status answering a handler that raised ``exc``."""
    if isinstance(exc, RpcError):
        return exc.code, exc.message
    # Nothing a handler raises may reach the wire as anything but a status, nor end the
    # reader: not even a log stream that fails.
    with contextlib.suppress(OSError, ValueError):
        log.exception("handler_failed", method=method, exc_info=exc)
    return StatusCode.UNKNOWN, f"{type(exc).__name__}: {bounded(str(exc), STATUS_TEXT_CHARS)}"


class _Stalled(Exception):
    """The peer stopped halfway: the rest of a frame, or room for answers, did not come."""
