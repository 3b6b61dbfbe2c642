"""Building the agent's connection to the API server from the credentials at hand, and
reading its raw responses.

Every answer (:mod:`.rest`) is read as JSON and its connection handed back to the pool here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
import urllib3

from common import jsondoc
from reconciler.kube.config import KubernetesConfig
from reconciler.kube.credentials import SERVICE_ACCOUNT, Credentials, CredentialsError, in_cluster
from reconciler.kube.kubeconfig import from_kubeconfig
from reconciler.kube.transport import Api

log = structlog.get_logger("nri_qos.kube")


def build_api_client(
    cfg: KubernetesConfig, environ: Mapping[str, str] | None = None,
    service_account: Path = SERVICE_ACCOUNT,
) -> Api | None:
    """A connection from the configured kubeconfig, else in-cluster config, else the default
    kubeconfig.

    Returns ``None`` (degraded mode, one warning) when access is disabled or nothing works.
    """
    env = os.environ if environ is None else environ
    if not cfg.enabled:
        log.info("kubernetes_disabled", detail="kubernetes.enabled is false; NRI data only")
        return None
    attempts: list[tuple[str, Callable[[], Credentials]]]
    if cfg.kubeconfig:
        path = Path(os.path.expanduser(cfg.kubeconfig))
        attempts = [(f"kubeconfig {path}",
                     lambda: from_kubeconfig(path, cfg.request_timeout_s))]
    else:
        default = _default_kubeconfig(env)
        attempts = [("in-cluster", lambda: in_cluster(env, service_account)),
                    (f"default kubeconfig {default}",
                     lambda: from_kubeconfig(default, cfg.request_timeout_s))]
    failures: list[str] = []
    for source, load in attempts:
        try:
            credentials = load()
            api = Api(credentials)
        # A CA or client certificate that does not load (ssl.SSLError is an OSError) only
        # means this source is unusable.
        except (CredentialsError, OSError, ValueError) as exc:
            failures.append(f"{source}: {exc}")
            continue
        log.info("kubernetes_config", source=credentials.source, host=credentials.server)
        if not credentials.verify:
            # urllib3 would otherwise warn on every request; the operator chose this once.
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
            log.warning("kubernetes_unverified", source=credentials.source,
                        detail="insecure-skip-tls-verify: the API server's certificate is "
                               "not checked")
        return api
    log.warning(
        "kubernetes_unavailable",
        detail="no usable API credentials; running degraded on NRI data only",
        tried=failures,
    )
    return None


def _default_kubeconfig(env: Mapping[str, str]) -> Path:
    """``KUBECONFIG``'s first file that exists (kubectl's list, split at ':'), else
    ``~/.kube/config``."""
    listed = [Path(os.path.expanduser(p)) for p in env.get("KUBECONFIG", "").split(":") if p]
    home = Path(os.path.expanduser(os.path.join(env.get("HOME", "~"), ".kube", "config")))
    return next((p for p in listed if p.is_file()), listed[0] if listed else home)


def read_json(response: Any) -> Any:
    """The body of a raw response, parsed; its connection goes back to the pool either way."""
    try:
        return jsondoc.loads(response.data)
    finally:
        response.release_conn()


def finish(response: Any) -> None:
    """Reads the rest of a raw response, then hands its connection back to the pool. A
    connection released with its body unread would give that body to the next request on it as
    the start of its answer."""
    try:
        response.read()
    finally:
        response.release_conn()


def resource_version(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata")
    value = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
    return value if isinstance(value, str) else ""


def rfc3339_now() -> str:
    """Now, as the API writes times (RFC 3339, UTC, whole seconds)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
