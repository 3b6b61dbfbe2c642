"""A bearer token from a kubeconfig's ``exec`` plugin (``client.authentication.k8s.io``): the
command the cloud provider ships (``aws eks get-token``, ``gke-gcloud-auth-plugin``,
``kubelogin``) prints an ExecCredential, whose token is kept until its
``expirationTimestamp`` and fetched again after it.

A token the server refuses (401) is dropped and the plugin run again at once, as kubectl
does: a token revoked before its expiry, or one without an expiry, is replaced without a
restart. A plugin that returns a client certificate instead of a token
is refused when the credentials are built: the agent would have to rebuild its connection
pool on every renewal.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog

from common import jsondoc
from reconciler.kube.credentials import CredentialsError

API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
# Fetched again this long before it expires, so that no request leaves with a token the
# server will find expired on arrival.
EARLY = timedelta(seconds=30)

log = structlog.get_logger("nri_qos.kube")


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(slots=True)
class ExecToken:
    """The token of ``command`` ``args``, run with ``env`` added to the agent's environment."""

    command: str
    args: Sequence[str]
    env: Mapping[str, str]
    api_version: str
    timeout_s: float
    cluster: Mapping[str, Any] | None = None
    """What ``provideClusterInfo`` hands the plugin (``spec.cluster``), or None."""
    clock: Callable[[], datetime] = _now
    _token: str = field(default="", init=False, repr=False)
    _expires: datetime | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def value(self) -> str:
        # Requests run in several worker threads; one plugin run serves them all.
        with self._lock:
            if not self._token or (self._expires is not None
                                   and self.clock() >= self._expires - EARLY):
                self._token, self._expires = self._fetch()
            return self._token

    def refused(self, token: str) -> bool:
        with self._lock:
            # Several requests may come back refused with one token: one plugin run for all.
            if token == self._token:
                self._token, self._expires = "", None
                log.info("kubernetes_token_refused", plugin=self.command,
                         detail="the API server answered 401; the exec plugin runs again")
        return True

    def _fetch(self) -> tuple[str, datetime | None]:
        spec: dict[str, Any] = {"interactive": False}
        if self.cluster is not None:
            spec["cluster"] = dict(self.cluster)
        info = {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": spec}
        env = {**os.environ, **self.env, "KUBERNETES_EXEC_INFO": json.dumps(info)}
        name = f"exec plugin {self.command}"
        try:
            done = subprocess.run([self.command, *self.args], env=env, capture_output=True,
                                  stdin=subprocess.DEVNULL, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CredentialsError(f"{name}: {exc}") from exc
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip()[-400:]
            raise CredentialsError(f"{name} exited with {done.returncode}: {said}")
        return parse(done.stdout, self.api_version, name)


def parse(output: bytes, api_version: str, name: str) -> tuple[str, datetime | None]:
    """The token and its expiry in a plugin's output."""
    try:
        credential = jsondoc.loads(output)
    except ValueError as exc:
        raise CredentialsError(f"{name} printed no JSON: {exc}") from exc
    if not isinstance(credential, dict) or credential.get("kind") != "ExecCredential":
        raise CredentialsError(f"{name} printed no ExecCredential")
    if credential.get("apiVersion") != api_version:
        raise CredentialsError(f"{name} answered {credential.get('apiVersion')!r} to a "
                               f"request for {api_version!r}")
    status = credential.get("status")
    token = status.get("token") if isinstance(status, dict) else None
    if not isinstance(token, str) or not token:
        raise CredentialsError(f"{name}: status.token is missing (a client certificate from "
                               f"an exec plugin is not supported)")
    expiry = status.get("expirationTimestamp") if isinstance(status, dict) else None
    if expiry is None:
        return token, None
    try:
        expires = datetime.fromisoformat(str(expiry).replace("Z", "+00:00"))
    except ValueError as exc:
        raise CredentialsError(f"{name}: status.expirationTimestamp {expiry!r}: {exc}") from exc
    if expires.tzinfo is None:
        raise CredentialsError(f"{name}: status.expirationTimestamp {expiry!r} has no zone")
    return token, expires
