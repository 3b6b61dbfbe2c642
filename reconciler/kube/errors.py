"""What a failed request means: the HTTP statuses the code acts on, which failures are worth a
retry, and how a failure is described in a log line or an audit record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import urllib3

from common import jsondoc
from reconciler.kube.credentials import CredentialsError

HTTP_NOT_FOUND = 404
HTTP_CONFLICT = 409
HTTP_GONE = 410
HTTP_TOO_MANY_REQUESTS = 429


class ApiError(Exception):
    """The API server answered outside 2xx: its ``status``, ``reason`` (the HTTP reason
    phrase), ``body`` (the Status object it sent, as text) and ``headers`` (the answer's, such
    as ``Retry-After``; urllib3's, whose names match in any case)."""

    def __init__(self, status: int, reason: str, body: str,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason
        self.body = body
        self.headers: Mapping[str, str] = {} if headers is None else headers


TRANSPORT = (urllib3.exceptions.HTTPError, OSError, CredentialsError)
"""The request did not get an answer (connection refused or dropped, timeout), or could not
be sent (its token could not be read)."""
TRANSIENT = (ApiError, *TRANSPORT, ValueError)
"""Errors a list or watch attempt, or a read-modify-write of the node, may end with; everything
else is a bug and propagates."""


def status_body(exc: ApiError) -> dict[str, Any] | None:
    """The Status object the API sent with an error; None when the body is not one."""
    try:
        body = jsondoc.loads(exc.body or "")
    except (ValueError, TypeError):
        return None
    return body if isinstance(body, dict) else None


def status_message(exc: ApiError, body: Mapping[str, Any] | None) -> str:
    """The ``message`` of the Status the API sent (``body``), else the HTTP reason."""
    if body is not None and isinstance(body.get("message"), str):
        return str(body["message"])
    return str(exc.reason or exc.status)


def describe(exc: BaseException) -> str:
    if isinstance(exc, ApiError):
        return f"HTTP {exc.status}: {status_message(exc, status_body(exc))}"
    return f"{type(exc).__name__}: {exc}"
