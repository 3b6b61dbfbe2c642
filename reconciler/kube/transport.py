"""The connection to the API server: one urllib3 pool over TLS, with the credentials on every
request.

Not the ``kubernetes`` package: importing any part of it imports all of it (every generated
API class and model, and pydantic), about 12 MiB of anonymous memory on every node, for a
pool, a TLS context and a header, which urllib3 and :mod:`ssl` give directly.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal

import urllib3

from reconciler.kube.credentials import Credentials

Timeout = float | tuple[float, float]
"""Seconds for the whole request, or (to connect, to read) for a stream."""

HTTP_UNAUTHORIZED = 401


def user_agent() -> str:
    try:
        return f"nri-qos/{version('nri-qos')}"
    except PackageNotFoundError:
        return "nri-qos"


class Api:
    """Sends requests to the server of ``credentials``; each answer comes back unread."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials
        self._agent = user_agent()
        pool: dict[str, Any] = {}
        if credentials.server.startswith("https://"):
            pool["ssl_context"] = tls_context(credentials)
            if credentials.client_files is not None:
                # Given as files, urllib3 loads them for every new connection: a client
                # certificate rotated on disk (kubelet's is) is used without a restart.
                pool["cert_file"], pool["key_file"] = map(str, credentials.client_files)
            if credentials.tls_server_name:
                pool["server_hostname"] = credentials.tls_server_name
                pool["assert_hostname"] = credentials.tls_server_name
        # One server; the agent's request threads (four for the writes, one for the watch)
        # each hold at most one connection, so none is ever opened only to be thrown away.
        self._pool = urllib3.PoolManager(num_pools=1, maxsize=8, **pool)

    def send(self, method: str, path_and_query: str, *, headers: Mapping[str, str],
             body: bytes | None, timeout: Timeout,
             retry: bool = True) -> urllib3.BaseHTTPResponse:
        """One request, its answer's body left unread (a watch streams it).

        ``retry``: urllib3's own retries (its default: up to three more tries of a request
        that could not connect, and of a GET whose answer timed out, each with the whole
        ``timeout``); False sends it once, for a caller whose wait must stay one ``timeout``.
        Sent once more when the server refuses its token (401) and the token's source then
        gives another: the server never acted on the refused one, so even a POST is safe to
        repeat."""
        token = self.credentials.token
        retries: Literal[False] | None = None if retry else False  # None: the pool's own
        if token is None:
            return self._send(method, path_and_query, headers, body, timeout, None, retries)
        used = token.value()
        answer = self._send(method, path_and_query, headers, body, timeout, used, retries)
        if answer.status != HTTP_UNAUTHORIZED or not token.refused(used):
            return answer
        try:
            fresh = token.value()
        except BaseException:
            _discard(answer)
            raise
        if fresh == used:
            return answer
        _discard(answer)
        return self._send(method, path_and_query, headers, body, timeout, fresh, retries)

    def _send(self, method: str, path_and_query: str, headers: Mapping[str, str],
              body: bytes | None, timeout: Timeout, token: str | None,
              retries: Literal[False] | None) -> urllib3.BaseHTTPResponse:
        sent = {"User-Agent": self._agent, **headers}
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        limit = (urllib3.Timeout(total=timeout) if isinstance(timeout, (int, float))
                 else urllib3.Timeout(connect=timeout[0], read=timeout[1]))
        return self._pool.request(method, self.credentials.server + path_and_query,
                                  body=body, headers=sent, timeout=limit, retries=retries,
                                  preload_content=False, redirect=False)

    def close(self) -> None:
        self._pool.clear()


def _discard(answer: urllib3.BaseHTTPResponse) -> None:
    """The connection of an answer nobody reads back to the pool, its body read first (an
    unread body would be taken for the next request's answer)."""
    answer.drain_conn()
    answer.release_conn()


def tls_context(credentials: Credentials) -> ssl.SSLContext:
    """Server checked against the cluster's CA (the system's where none is named), or not at
    all (urllib3 takes its own check's setting from the context's); a client certificate given
    as data loaded once, from a private temporary file removed at once."""
    context = ssl.create_default_context(
        cafile=None if credentials.ca_file is None else str(credentials.ca_file),
        cadata=None if credentials.ca_data is None else credentials.ca_data.decode("ascii"),
    )
    if not credentials.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if credentials.client_data is not None:
        with tempfile.TemporaryDirectory(prefix="nri-qos-cert-") as scratch:
            cert = os.path.join(scratch, "cert.pem")
            key = os.path.join(scratch, "key.pem")
            for name, data in zip((cert, key), credentials.client_data, strict=True):
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
            context.load_cert_chain(cert, key)
    return context
