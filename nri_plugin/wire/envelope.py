"""The ttrpc envelope: ``ttrpc.Request`` / ``ttrpc.Response`` around an NRI message.

Encoding and decoding only; the frames themselves are :mod:`nri_plugin.wire.ttrpc`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from nri_plugin.wire.errors import EnvelopeError
from nri_plugin.wire.status import StatusCode
from protos import ttrpc_envelope_pb2 as envelope


@dataclass(frozen=True, slots=True)
class Reply:
    """A decoded ``ttrpc.Response``; an absent status means OK, as in the Go client."""

    code: int
    message: str
    payload: bytes

    @property
    def ok(self) -> bool:
        return self.code == StatusCode.OK


def encode_request(service: str, method: str, payload: bytes, timeout_nano: int = 0) -> bytes:
    return envelope.Request(
        service=service, method=method, payload=payload, timeout_nano=timeout_nano
    ).SerializeToString()


def decode_request(data: bytes) -> envelope.Request:
    request = envelope.Request()
    try:
        request.ParseFromString(data)
    except DecodeError as exc:
        raise EnvelopeError(f"ttrpc request does not decode: {exc}") from exc
    return request


def encode_response(payload: bytes = b"", code: int = StatusCode.OK, message: str = "") -> bytes:
    # The Go server always fills the status, also for OK ({code: 0} encodes as 0a 00).
    return envelope.Response(
        status=envelope.Status(code=code, message=message), payload=payload
    ).SerializeToString()


def decode_response(data: bytes) -> Reply:
    response = envelope.Response()
    try:
        response.ParseFromString(data)
    except DecodeError as exc:
        raise EnvelopeError(f"ttrpc response does not decode: {exc}") from exc
    status = response.status
    return Reply(status.code, status.message, response.payload)
