"""Requests to the API server: method, path, query and JSON body, sent through the client's
connection pool and credentials, answered raw.

Not through the client's generated API classes: building ``CoreV1Api`` and ``AppsV1Api`` adds
about 24 MiB of anonymous memory to the agent on every node (a pydantic validator for each of
their 536 methods, and the models they name), for the seven requests the agent makes, whose
answers it reads as JSON anyway (``bench/agent_idle.py`` prints the agent's memory). Paths and
query parameters are the API's own names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
# The client's name for bearer-token credentials (a service account's token, a kubeconfig's
# token or exec plugin); client certificates go with its connection pool.
AUTH = ["BearerToken"]

Timeout = float | tuple[float, float]
"""Seconds for the whole request, or (to connect, to read) for a stream."""
Query = Sequence[tuple[str, str | int | bool]]


def segment(name: str) -> str:
    """``name`` as one path segment: a '/' in it cannot reach another resource."""
    return quote(name, safe="")


class Rest:
    """The API server behind ``api``. :meth:`request` returns the response with its body
    unread; the caller reads it (``read_json``, ``finish`` or a stream reader) and so hands its
    connection back."""

    def __init__(self, api: ApiClient) -> None:
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
    ) -> Any:
        """Sends one request; an answer outside 2xx raises the client's ``ApiException`` (its
        ``status``, and the Status object the API sent as its ``body``)."""
        headers = {"Accept": JSON}
        if body is not None:
            headers["Content-Type"] = content_type
        sent = self._api.param_serialize(method, path, query_params=list(query),
                                         header_params=headers, body=body, auth_settings=AUTH)
        answer: Any = self._api.call_api(*sent, _request_timeout=timeout)
        raw = answer.response
        if not 200 <= answer.status <= 299:
            try:
                answer.read()
            finally:
                raw.release_conn()
            raise ApiException.from_response(http_resp=answer, body=None, data=None)
        return raw
