"""Evicting a pod through the Eviction API, and the drain check of a pod's DaemonSet owner."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import structlog

from common.audit import AuditLog
from common.podmeta import OwnerRef
from reconciler.kube.client import finish, read_json
from reconciler.kube.config import KubernetesConfig
from reconciler.kube.errors import (
    HTTP_CONFLICT,
    HTTP_NOT_FOUND,
    HTTP_TOO_MANY_REQUESTS,
    TRANSPORT,
    ApiError,
    describe,
    status_body,
    status_message,
)
from reconciler.kube.rest import Rest, segment
from reconciler.kube.threads import ApiThreads

log = structlog.get_logger("nri_qos.kube")

MIN_GRACE_S = 1
"""The shortest grace period an eviction may ask for. 0 means immediate deletion: the pod gets
no SIGTERM and no graceful shutdown, and the kubelet's record of it goes at once."""


class EvictionOutcome(enum.StrEnum):
    EVICTED = "evicted"  # the API accepted the eviction (or would have, in a dry run)
    BLOCKED = "blocked"  # 429: a PodDisruptionBudget forbids it now, or the API throttles
    GONE = "gone"  # 404: the pod no longer exists
    FAILED = "failed"  # any other refusal or a transport error
    UNAVAILABLE = "unavailable"  # degraded mode: no API client


@dataclasses.dataclass(frozen=True, slots=True)
class EvictionResult:
    outcome: EvictionOutcome
    dry_run: bool
    status: int | None = None  # HTTP status when the API answered
    message: str = ""


class Evictions:
    """Asks for evictions (audited here) and checks owners; ``rest`` None: degraded."""

    def __init__(self, rest: Rest | None, cfg: KubernetesConfig, audit: AuditLog,
                 threads: ApiThreads) -> None:
        self._rest = rest
        self._cfg = cfg
        self._audit = audit
        self._threads = threads

    async def evict(
        self,
        namespace: str,
        name: str,
        grace_seconds: int | None,
        dry_run: bool,
        *,
        uid: str | None = None,
        reason: str = "unspecified",
    ) -> EvictionResult:
        """See :meth:`reconciler.kube.actions.KubeActions.evict`."""
        if grace_seconds is not None and grace_seconds < MIN_GRACE_S:
            raise ValueError(f"grace period {grace_seconds} s is below {MIN_GRACE_S} s")
        pod = f"{namespace}/{name}"
        self._audit.record("eviction_requested", pod=pod, reason=reason, dry_run=dry_run)
        if self._rest is None:
            self._audit.record("eviction_blocked", pod=pod, reason="no Kubernetes API access")
            return EvictionResult(EvictionOutcome.UNAVAILABLE, dry_run)
        rest = self._rest
        body: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "Eviction",
                                "metadata": {"name": name, "namespace": namespace}}
        options: dict[str, Any] = {}
        if grace_seconds is not None:
            options["gracePeriodSeconds"] = grace_seconds
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        if options:
            body["deleteOptions"] = options

        def post() -> int:
            response = rest.request(
                "POST", f"/api/v1/namespaces/{segment(namespace)}/pods/{segment(name)}/eviction",
                body=body, query=[("dryRun", "All")] if dry_run else (),
                timeout=self._cfg.request_timeout_s)
            finish(response)
            return int(response.status)

        try:
            status = await self._threads.run(post)
        except ApiError as exc:
            sent = status_body(exc)
            message = status_message(exc, sent)
            if exc.status == HTTP_NOT_FOUND or (exc.status == HTTP_CONFLICT and uid is not None):
                # 409 on a uid precondition: a pod of that name exists, but not the one the
                # decision was about (re-created); that one is gone.
                self._audit.record("eviction_gone", pod=pod, status=exc.status)
                return EvictionResult(EvictionOutcome.GONE, dry_run, exc.status, message)
            blocked = exc.status == HTTP_TOO_MANY_REQUESTS
            if not blocked:
                why = f"API error: {message}"
            elif _budget_refused(sent):
                why = f"disruption budget: {message}"
            else:
                # The API server's own throttling (Priority and Fairness): nothing was decided
                # about the pod, the eviction is tried again after the backoff.
                why = f"throttled by the API server: {message}"
            self._audit.record("eviction_blocked", pod=pod, status=exc.status, reason=why)
            outcome = EvictionOutcome.BLOCKED if blocked else EvictionOutcome.FAILED
            return EvictionResult(outcome, dry_run, exc.status, message)
        except TRANSPORT as exc:
            self._audit.record("eviction_blocked", pod=pod, reason=f"transport: {exc}")
            return EvictionResult(EvictionOutcome.FAILED, dry_run, None, str(exc))
        self._audit.record("eviction_done", pod=pod, dry_run=dry_run, status=status)
        return EvictionResult(EvictionOutcome.EVICTED, dry_run, status)

    async def owner_exists(self, namespace: str, owner: OwnerRef) -> bool | None:
        """See :meth:`reconciler.kube.actions.KubeActions.owner_exists`."""
        if self._rest is None:
            return None
        rest = self._rest

        def read() -> bool:
            found = read_json(rest.request(
                "GET", f"/apis/apps/v1/namespaces/{segment(namespace)}/daemonsets/"
                f"{segment(owner.name)}", timeout=self._cfg.request_timeout_s))
            meta = found.get("metadata") if isinstance(found, dict) else None
            return isinstance(meta, dict) and meta.get("uid") == owner.uid

        try:
            return await self._threads.run(read)
        except ApiError as exc:
            if exc.status == HTTP_NOT_FOUND:
                return False
            log.warning("owner_check_failed", namespace=namespace, owner=owner.name,
                        reason=describe(exc))
        except (*TRANSPORT, ValueError) as exc:
            log.warning("owner_check_failed", namespace=namespace, owner=owner.name,
                        reason=describe(exc))
        return None


def _budget_refused(body: Mapping[str, Any] | None) -> bool:
    """A 429 from a PodDisruptionBudget: its Status (``body``) names the cause
    ``DisruptionBudget``."""
    details = body.get("details") if body is not None else None
    causes = details.get("causes") if isinstance(details, dict) else None
    return isinstance(causes, list) and any(
        isinstance(cause, dict) and cause.get("reason") == "DisruptionBudget" for cause in causes)
