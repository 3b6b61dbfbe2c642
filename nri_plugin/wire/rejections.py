"""What the plugin refused on the NRI connection: counted always, logged without flooding.

A runtime that sends garbage sends a lot of it. Every refusal is counted by kind, for the whole
life of the agent (:class:`RejectionCounts`, what metrics export); on one connection the first
refusal of each kind is logged at warning level with what was refused, later ones of that kind
only add to the counts, and when the connection ends one line gives the counts
(:class:`ConnectionRejections`). So a flood of garbage costs the log a line per kind, not a line
per frame.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import structlog

from hooks.untrusted import bounded

DETAIL_CHARS = 256
"""Characters of the refused input quoted in the warning (the rest is counted, not kept)."""

log = structlog.get_logger("nri_qos.nri")


class Rejection(StrEnum):
    """The kinds of refusal on the wire, as they appear in logs and metrics."""

    LOST_FRAMING = "lost_framing"
    """The mux framing cannot be followed any more: the connection is closed."""
    STALLED = "stalled"
    """The peer stopped halfway through a frame, or stopped reading its answers."""
    UNKNOWN_CONNECTION = "unknown_connection"
    """A mux frame for a logical connection other than 1 and 2 (skipped)."""
    UNKNOWN_FRAME_TYPE = "unknown_frame_type"
    """A ttrpc frame that is neither a request (served side) nor a response (calling side)."""
    OVERSIZED_FRAME = "oversized_frame"
    """A ttrpc frame over 4 MiB: skipped, that stream answered RESOURCE_EXHAUSTED."""
    BAD_STREAM_ID = "bad_stream_id"
    """A request on an even stream id, or one not above the last (answered INVALID_ARGUMENT)."""
    BAD_ENVELOPE = "bad_envelope"
    """A ttrpc request or response that does not decode."""
    UNKNOWN_SERVICE = "unknown_service"
    UNKNOWN_METHOD = "unknown_method"
    STRAY_RESPONSE = "stray_response"
    """A response for no call in flight (e.g. one that came after its call timed out)."""
    BAD_PAYLOAD = "bad_payload"
    """An NRI message that does not decode."""
    OUT_OF_ORDER = "out_of_order"
    """A request the session is not ready for: an event or Synchronize before Configure."""
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    """The runtime did not take the next step of the handshake in time."""
    SYNCHRONIZE_OVER_LIMIT = "synchronize_over_limit"
    """A Synchronize carried more pods, containers or bytes than the plugin takes."""


class RejectionCounts:
    """Refusals by kind; every kind is present, at 0 until it happens."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(Rejection, 0)

    def add(self, kind: Rejection, count: int = 1) -> int:
        """Count ``count`` more of ``kind``; the new total."""
        total = self._counts[kind] + count
        self._counts[kind] = total
        return total

    def __getitem__(self, kind: Rejection) -> int:
        return self._counts[kind]

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def as_dict(self) -> dict[str, int]:
        """Every kind with its count (zeros included), by the kind's name."""
        return {kind.value: count for kind, count in self._counts.items()}


class ConnectionRejections:
    """The refusals of one connection, added to the agent's ``totals`` as they happen."""

    def __init__(self, totals: RejectionCounts | None = None, **fields: Any) -> None:
        self.counts = RejectionCounts()
        self._totals = totals
        self._fields = fields

    def __call__(self, kind: Rejection, detail: str, count: int = 1, **fields: Any) -> None:
        """Count ``count`` refusals of ``kind``; the first of its kind on this connection is
        logged with ``detail`` (bounded: it may quote the refused input) and ``fields``."""
        if self._totals is not None:
            self._totals.add(kind, count)
        if self.counts.add(kind, count) == count:
            log.warning("nri_rejected", kind=kind.value, detail=bounded(detail, DETAIL_CHARS),
                        **self._fields, **fields,
                        note="further ones of this kind on this connection are only counted")

    def summarize(self) -> None:
        """One line with the counts, when the connection refused anything at all."""
        counts = {name: n for name, n in self.counts.as_dict().items() if n}
        if counts:
            log.warning("nri_rejections", counts=counts, **self._fields)
