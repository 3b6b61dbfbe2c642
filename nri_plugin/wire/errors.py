"""Exceptions shared across the plugin's layers."""

from __future__ import annotations


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
