"""Decoding an NRI message from a request's or a response's payload."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)


def parse_message(message_type: type[M], payload: bytes) -> M | None:
    """The message ``payload`` holds; None when it does not decode."""
    message = message_type()
    try:
        message.ParseFromString(payload)
    except DecodeError:
        return None
    return message
