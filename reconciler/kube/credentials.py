"""Where the API server is and how the agent proves who it is: the server's address, what
its certificate is checked against, the client certificate, and the bearer token.

The in-cluster source is here (the pod's service account); a kubeconfig is read by
:mod:`.kubeconfig`. Tokens are read when a request is sent, not when the credentials are
built: kubelet rewrites a projected service-account token before it expires (an hour by
default), and a token file named in a kubeconfig may be rewritten the same way.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where kubelet mounts a pod's service-account token and the cluster's CA."""


class CredentialsError(Exception):
    """A source of credentials cannot be used; the message says which field and why."""


class Token(Protocol):
    """A bearer token, as it is now."""

    def value(self) -> str: ...

    def refused(self, token: str) -> bool:
        """The server answered 401 to a request that carried ``token``; True when the token
        may be another one if asked for again."""
        ...


@dataclass(frozen=True, slots=True)
class FixedToken:
    """A token written into the kubeconfig itself."""

    token: str

    def value(self) -> str:
        return self.token

    def refused(self, token: str) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class TokenFile:
    """A token in a file that its owner rewrites: read again for every request (a few
    hundred bytes, and the agent sends a handful of requests a minute)."""

    path: Path

    def value(self) -> str:
        try:
            token = self.path.read_text().strip()
        except OSError as exc:
            raise CredentialsError(f"token file {self.path}: {exc.strerror or exc}") from exc
        if not token:
            raise CredentialsError(f"token file {self.path} is empty")
        return token

    def refused(self, token: str) -> bool:
        # Its owner may have rewritten it since it was read for the refused request.
        return True


@dataclass(frozen=True, slots=True)
class Credentials:
    """Everything a request needs besides its own method, path and body.

    Certificates and keys are either files (read again for every new connection, so a
    rotated client certificate, like kubelet's, takes effect without a restart) or PEM bytes
    from the kubeconfig itself.
    """

    server: str
    """``https://host:port`` (``http://`` only where a kubeconfig says so)."""
    source: str
    """Where these came from, for the log: ``in-cluster`` or ``kubeconfig <path>``."""
    ca_file: Path | None = None
    ca_data: bytes | None = None
    client_files: tuple[Path, Path] | None = None
    """The client certificate and its key, as files."""
    client_data: tuple[bytes, bytes] | None = None
    """The client certificate and its key, as PEM."""
    token: Token | None = None
    verify: bool = True
    """False only where the kubeconfig sets ``insecure-skip-tls-verify``."""
    tls_server_name: str = ""
    """The name the server's certificate is checked against, where it differs from the
    server's host."""


def in_cluster(environ: Mapping[str, str],
               service_account: Path = SERVICE_ACCOUNT) -> Credentials:
    """The pod's service account: the API server's Service address kubelet puts in the
    environment, the token and the cluster's CA it mounts."""
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    port = environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise CredentialsError("KUBERNETES_SERVICE_HOST or KUBERNETES_SERVICE_PORT is not set "
                               "(not running in a pod)")
    token = TokenFile(service_account / "token")
    token.value()
    ca = service_account / "ca.crt"
    if not ca.is_file():
        raise CredentialsError(f"{ca} is missing")
    return Credentials(server=f"https://{_host(host)}:{port}", source="in-cluster", ca_file=ca,
                       token=token)


def _host(host: str) -> str:
    # An IPv6 Service address goes in brackets in a URL.
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host
