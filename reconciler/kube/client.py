"""Building the API client from the credentials at hand, and reading its raw responses.

Every answer (:mod:`.rest`) is read as JSON, never deserialized into the client's models, and
its connection handed back to the pool here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import structlog
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client import ApiClient

from reconciler.kube.config import KubernetesConfig

log = structlog.get_logger("nri_qos.kube")

Api = ApiClient
"""The client handle :func:`build_api_client` returns, for callers that pass it on."""


def build_api_client(
    cfg: KubernetesConfig, environ: Mapping[str, str] | None = None
) -> ApiClient | None:
    """A client from the configured kubeconfig, else in-cluster config, else the default kubeconfig.

    Returns ``None`` (degraded mode, one warning) when access is disabled or nothing works.
    """
    env = os.environ if environ is None else environ
    if not cfg.enabled:
        log.info("kubernetes_disabled", detail="kubernetes.enabled is false; NRI data only")
        return None
    if cfg.kubeconfig:
        attempts = [("kubeconfig", cfg.kubeconfig)]
    else:
        default = env.get("KUBECONFIG") or os.path.join(env.get("HOME", "~"), ".kube", "config")
        attempts = [("in-cluster", ""), ("default kubeconfig", default)]
    failures: list[str] = []
    for source, path in attempts:
        # A fresh object per source: a loader that fails halfway must leave nothing behind.
        configuration = k8s_client.Configuration()
        try:
            if path:
                k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=os.path.expanduser(path),
                    client_configuration=configuration,
                    persist_config=False,
                )
            else:
                k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
                    client_configuration=configuration
                )
        # Loaders fail in many ways (missing file, bad YAML, missing fields, exec plugins);
        # each only means this source is unusable.
        except Exception as exc:
            failures.append(f"{source}{' ' + path if path else ''}: {exc}")
            continue
        log.info("kubernetes_config", source=source, path=path or None, host=configuration.host)
        return ApiClient(configuration=configuration)
    log.warning(
        "kubernetes_unavailable",
        detail="no usable API credentials; running degraded on NRI data only",
        tried=failures,
    )
    return None


def read_json(response: Any) -> Any:
    """The body of a raw response, parsed; its connection goes back to the pool either way."""
    try:
        return json.loads(response.data)
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
