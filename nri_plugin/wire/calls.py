"""The calls one side of a ttrpc connection has made and not yet had answered.

:class:`PendingCalls` numbers each call's stream, encodes its request frame, and resolves the
call's future from the response frame that comes back (or fails it); the
:class:`~nri_plugin.wire.transport.TtrpcPeer` that owns it does the writing and the waiting.
Frames the peer sends where no call waits are refused and counted, never trusted.
"""

from __future__ import annotations

import asyncio

from nri_plugin.wire.envelope import decode_response, encode_request
from nri_plugin.wire.errors import EnvelopeError, RpcError
from nri_plugin.wire.rejections import ConnectionRejections, Rejection
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.ttrpc import ClientStreams, Frame, MessageType, encode_frame, oversized_message


class PendingCalls:
    """This side's calls waiting for an answer, by stream id; refusals go to ``rejections``."""

    def __init__(self, rejections: ConnectionRejections) -> None:
        self._rejections = rejections
        self._client_streams = ClientStreams()
        self._pending: dict[int, asyncio.Future[bytes]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, service: str, method: str, payload: bytes,
              timeout_s: float) -> tuple[int, bytes, asyncio.Future[bytes]]:
        """A new call's stream id, request frame, and the future its answer will resolve.

        Raises :class:`~nri_plugin.wire.errors.StreamIdsExhausted` when the stream ids ran out
        and :class:`~nri_plugin.wire.errors.MessageTooLarge` for a request over the limit (no
        stream is then taken).
        """
        stream_id = self._client_streams.open()
        try:
            frame = encode_frame(stream_id, MessageType.REQUEST,
                                 encode_request(service, method, payload, int(timeout_s * 1e9)))
        except BaseException:
            self._client_streams.close(stream_id)
            raise
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        return stream_id, frame, future

    def forget(self, stream_id: int) -> None:
        """The call on ``stream_id`` is over, answered or not: its stream id may be reused."""
        if self._pending.pop(stream_id, None) is not None:
            self._client_streams.close(stream_id)

    def on_frame(self, frame: Frame) -> None:
        """Resolve the call ``frame`` answers."""
        stream_id = frame.stream_id
        future = self._pending.pop(stream_id, None)
        self._client_streams.close(stream_id)
        if future is None or future.done():
            self._rejections(Rejection.STRAY_RESPONSE, f"frame of type {frame.type} on stream "
                             f"{stream_id}, which has no call waiting", stream_id=stream_id)
            return
        if frame.oversized:
            message = oversized_message(frame.oversized)
            self._rejections(Rejection.OVERSIZED_FRAME, message, stream_id=stream_id)
            future.set_exception(RpcError(StatusCode.RESOURCE_EXHAUSTED, message))
            return
        if frame.type != MessageType.RESPONSE:
            self._rejections(Rejection.UNKNOWN_FRAME_TYPE, f"frame of type {frame.type} where "
                             "responses are expected", stream_id=stream_id)
            future.set_exception(
                RpcError(StatusCode.INTERNAL, f"unexpected frame type {frame.type} for a call")
            )
            return
        try:
            reply = decode_response(frame.data)
        except EnvelopeError as exc:
            self._rejections(Rejection.BAD_ENVELOPE, str(exc), stream_id=stream_id)
            future.set_exception(RpcError(StatusCode.INTERNAL, str(exc)))
            return
        if reply.ok:
            future.set_result(reply.payload)
        else:
            future.set_exception(RpcError(reply.code, reply.message))

    def fail_all(self, error: Exception) -> None:
        """Fail every call still waiting with ``error`` (the connection ended)."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
