"""Every error of the wire layer: framing, envelopes, statuses, calls, connections, messages."""

from __future__ import annotations

from nri_plugin.wire.status import StatusCode


class ProtocolError(Exception):
    """The peer broke the wire protocol (mux or ttrpc framing).

    The byte stream can no longer be trusted to be in sync, so the only safe
    reaction is to close the connection (and reconnect). Decoders that raise it
    stay failed: every later ``feed`` raises it again.
    """


class MessageTooLarge(ValueError):
    """A message we were about to send exceeds the ttrpc size limit.

    Raised locally before anything is written, so the connection stays usable;
    the caller reports the failure (``RESOURCE_EXHAUSTED``) instead of sending a
    frame the peer would discard.
    """

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"message data of {length} bytes exceeds the ttrpc limit of {limit} bytes")
        self.length = length
        self.limit = limit


class StreamIdsExhausted(RuntimeError):
    """A ttrpc client used up its 32-bit stream id space; the connection must be replaced."""


class RpcError(Exception):
    """A call ended with a non-OK status, or a handler wants to answer with one."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{_code_name(code)}: {message}")
        self.code = code
        self.message = message


class EnvelopeError(ValueError):
    """Bytes that do not decode as a ttrpc envelope."""


class CallTimedOut(RpcError):
    """No answer came within the call's timeout (a local verdict, unlike an error status the
    peer sent, even one with the same code)."""


class ConnectionClosed(Exception):
    """The connection is gone; pending and later calls fail with this."""


class MessageError(ValueError):
    """A runtime message lacks what the plugin needs to act on it, or carries what no real pod
    or container has."""


def _code_name(code: int) -> str:
    try:
        return StatusCode(code).name
    except ValueError:
        return f"code {code}"
