"""Requests to the API server: method, path, query and JSON body, sent through the agent's
connection (:mod:`.transport`), answered raw.

The agent makes eight requests, and reads every answer as JSON; paths and query parameters
are the API's own names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from reconciler.kube.errors import ApiError
from reconciler.kube.transport import Api, Timeout

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"

Query = Sequence[tuple[str, str | int | bool]]


def segment(name: str) -> str:
    """``name`` as one path segment: a '/' in it cannot reach another resource."""
    return quote(name, safe="")


def _query(query: Query) -> str:
    # The API reads booleans as the words Go writes.
    pairs = [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in query]
    return "?" + urlencode(pairs) if pairs else ""


class Rest:
    """The API server behind ``api``. :meth:`request` returns the response with its body
    unread; the caller reads it (``read_json``, ``finish`` or a stream reader) and so hands its
    connection back."""

    def __init__(self, api: Api) -> None:
        self._api = api

    def request(
        self,
        method: str,
        path: str,
        *,
        timeout: Timeout,
        query: Query = (),
        body: Mapping[str, Any] | None = None,
        content_type: str = JSON,
        retry: bool = True,
    ) -> Any:
        """Sends one request; an answer outside 2xx raises :class:`ApiError` (its ``status``,
        the Status object the API sent as its ``body``, and the answer's ``headers``).
        ``retry``: as :meth:`~reconciler.kube.transport.Api.send`'s."""
        headers = {"Accept": JSON}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        answer = self._api.send(method, path + _query(query), headers=headers, body=data,
                                timeout=timeout, retry=retry)
        if not 200 <= answer.status <= 299:
            try:
                text = answer.read().decode(errors="replace")
            finally:
                answer.release_conn()
            raise ApiError(answer.status, answer.reason or "", text, answer.headers)
        return answer
