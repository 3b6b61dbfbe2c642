"""Credentials from a kubeconfig file: its current context's cluster and user.

What a node agent meets: a cluster's ``server``, its CA (file or data), ``tls-server-name`` and
``insecure-skip-tls-verify``; a user's client certificate and key (files, as kubelet's own
kubeconfig names its rotating ones, or data), ``token``, ``tokenFile`` and ``exec`` plugins.
Fields that would change who the agent is or route it elsewhere without it knowing
(``auth-provider``, basic auth, impersonation, ``proxy-url``) are refused by name, not
ignored: a kubeconfig that relies on them would otherwise reach the server as someone else.
Relative paths are the kubeconfig's directory's, as kubectl reads them.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from reconciler.kube.credentials import Credentials, CredentialsError, FixedToken, TokenFile
from reconciler.kube.exec_credential import API_VERSIONS, ExecToken

REFUSED_USER = {
    "auth-provider": "not supported; use an exec plugin",
    "username": "basic authentication is not supported",
    "password": "basic authentication is not supported",
    "as": "impersonation is not supported",
    "as-uid": "impersonation is not supported",
    "as-groups": "impersonation is not supported",
    "as-user-extra": "impersonation is not supported",
}
_T = TypeVar("_T")
# The largest kubeconfig read: one with a few clusters' CA bundles is tens of KiB.
MAX_BYTES = 1 << 20


def from_kubeconfig(path: Path, exec_timeout_s: float) -> Credentials:
    """The credentials of ``path``'s current context."""
    try:
        with path.open("rb") as file:
            text = file.read(MAX_BYTES + 1)
    except OSError as exc:
        raise CredentialsError(exc.strerror or str(exc)) from exc
    if len(text) > MAX_BYTES:
        raise CredentialsError(f"larger than {MAX_BYTES} bytes")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CredentialsError(f"not YAML: {exc}") from exc
    except RecursionError as exc:
        # The loader builds nested collections by recursion: a few kilobytes of brackets
        # exceed Python's limit, an error no caller's handling of bad credentials expects.
        raise CredentialsError("not a kubeconfig: YAML nested too deeply to load") from exc
    if not isinstance(doc, dict):
        raise CredentialsError("not a kubeconfig (no mapping at its top)")
    current = doc.get("current-context")
    if not isinstance(current, str) or not current:
        raise CredentialsError("current-context is not set")
    context = _named(doc, "contexts", current, "context")
    cluster_name, user_name = context.get("cluster"), context.get("user")
    if not isinstance(cluster_name, str):
        raise CredentialsError(f"contexts[{current}].context.cluster is not set")
    cluster = _named(doc, "clusters", cluster_name, "cluster")
    user = _named(doc, "users", user_name, "user") if isinstance(user_name, str) else {}
    where = f"clusters[{cluster_name}].cluster"
    server = _text(cluster, "server", where)
    if not server.startswith(("https://", "http://")):
        raise CredentialsError(f"{where}.server: must be an http(s) URL, got {server!r}")
    if "proxy-url" in cluster:
        raise CredentialsError(f"{where}.proxy-url: not supported")
    base = path.parent
    who = f"users[{user_name}].user"
    for key, why in REFUSED_USER.items():
        if key in user:
            raise CredentialsError(f"{who}.{key}: {why}")
    for one, other in (("client-certificate", "client-key"),
                       ("client-certificate-data", "client-key-data")):
        if (one in user) != (other in user):
            given, missing = (one, other) if one in user else (other, one)
            raise CredentialsError(f"{who}.{given}: needs {missing} too")
    verify = cluster.get("insecure-skip-tls-verify", False)
    if not isinstance(verify, bool):
        raise CredentialsError(f"{where}.insecure-skip-tls-verify: must be true or false")
    return Credentials(
        server=server.rstrip("/"), source=f"kubeconfig {path}",
        ca_file=_file(cluster, "certificate-authority", where, base),
        ca_data=_data(cluster, "certificate-authority-data", where),
        client_files=_pair(_file(user, "client-certificate", who, base),
                           _file(user, "client-key", who, base)),
        client_data=_pair(_data(user, "client-certificate-data", who),
                          _data(user, "client-key-data", who)),
        token=_token(user, who, base, cluster, exec_timeout_s),
        verify=not verify,
        tls_server_name=_text(cluster, "tls-server-name", where, required=False),
    )


def _pair(cert: _T | None, key: _T | None) -> tuple[_T, _T] | None:
    return None if cert is None or key is None else (cert, key)


def _named(doc: Mapping[str, Any], section: str, name: str, key: str) -> Mapping[str, Any]:
    entries = doc.get(section)
    if not isinstance(entries, list):
        raise CredentialsError(f"{section} is not a list")
    for entry in entries:
        if isinstance(entry, dict) and entry.get("name") == name:
            body = entry.get(key)
            if not isinstance(body, dict):
                raise CredentialsError(f"{section}[{name}].{key} is not a mapping")
            return body
    raise CredentialsError(f"{section} has no entry named {name!r}")


def _text(body: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> str:
    value = body.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or not value:
        raise CredentialsError(f"{where}.{key}: must be a non-empty string")
    return value


def _file(body: Mapping[str, Any], key: str, where: str, base: Path) -> Path | None:
    if key not in body:
        return None
    path = base / _text(body, key, where)
    if not path.is_file():
        raise CredentialsError(f"{where}.{key}: {path} is not a file")
    return path


def _data(body: Mapping[str, Any], key: str, where: str) -> bytes | None:
    if key not in body:
        return None
    try:
        return base64.b64decode(_text(body, key, where), validate=True)
    except binascii.Error as exc:
        raise CredentialsError(f"{where}.{key}: not base64: {exc}") from exc


def _token(user: Mapping[str, Any], who: str, base: Path, cluster: Mapping[str, Any],
           exec_timeout_s: float) -> FixedToken | TokenFile | ExecToken | None:
    if "token" in user:
        return FixedToken(_text(user, "token", who))
    if "tokenFile" in user:
        file = TokenFile(base / _text(user, "tokenFile", who))
        file.value()
        return file
    plugin = user.get("exec")
    if plugin is None:
        return None
    where = f"{who}.exec"
    if not isinstance(plugin, dict):
        raise CredentialsError(f"{where} is not a mapping")
    version = _text(plugin, "apiVersion", where)
    if version not in API_VERSIONS:
        raise CredentialsError(f"{where}.apiVersion: one of {', '.join(API_VERSIONS)}, "
                               f"got {version!r}")
    if plugin.get("interactiveMode") == "Always":
        raise CredentialsError(f"{where}.interactiveMode: Always needs a terminal; the agent "
                               f"has none")
    command = _text(plugin, "command", where)
    if "/" in command and not command.startswith("/"):
        command = str(base / command)
    args, env = plugin.get("args") or [], plugin.get("env") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise CredentialsError(f"{where}.args: must be a list of strings")
    if not isinstance(env, list) or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str)
            and isinstance(e.get("value"), str) for e in env):
        raise CredentialsError(f"{where}.env: must be a list of {{name, value}} strings")
    shown = None
    if plugin.get("provideClusterInfo") is True:
        shown = {k: cluster[k] for k in ("server", "certificate-authority-data",
                                         "insecure-skip-tls-verify", "tls-server-name")
                 if k in cluster}
    token = ExecToken(command=command, args=tuple(args), env={e["name"]: e["value"] for e in env},
                      api_version=version, timeout_s=exec_timeout_s, cluster=shown)
    token.value()
    return token
