"""Evicting a pod through the Eviction API, and the drain check of a pod's DaemonSet owner."""

from __future__ import annotations

import dataclasses
import enum
import functools
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
    TRANSIENT,
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
MAX_RETRY_AFTER_S = 300
"""The longest ``Retry-After`` an eviction's answer is taken at. Priority and Fairness asks for
a second or so, a disruption budget the controller has not counted yet for 10 s; a pod chosen
under memory pressure that waits longer than five minutes on one header leaves the pressure to
the kubelet's own eviction."""
READ_BACK_TIMEOUT_S = 2.0
"""The longest wait for the read of a pod whose eviction answered 409, and the read is sent
once (urllib3 would send a GET that timed out three more times): the API server answers a read
of one pod in milliseconds, and a round's evictions are made one after another, under memory
pressure, so a slow read must not hold the next candidates for several request timeouts. A pod
not read back in time counts as not readable (``failed``, tried again after its backoff)."""


class EvictionOutcome(enum.StrEnum):
    EVICTED = "evicted"  # the API accepted the eviction (or would have, in a dry run)
    BLOCKED = "blocked"  # 429: a PodDisruptionBudget forbids it now, or the API throttles
    # 404: the pod no longer exists; 409 on the uid precondition with the pod read back gone or
    # another one
    GONE = "gone"
    FAILED = "failed"  # any other refusal (a 409 about the same pod too) or a transport error
    UNAVAILABLE = "unavailable"  # degraded mode: no API client


@dataclasses.dataclass(frozen=True, slots=True)
class EvictionResult:
    outcome: EvictionOutcome
    dry_run: bool
    status: int | None = None  # HTTP status when the API answered
    message: str = ""
    # The answer's Retry-After, in whole seconds up to MAX_RETRY_AFTER_S: not asked again sooner.
    retry_after_s: int | None = None
    # A 429 of the API server's own throttling (Priority and Fairness), not a disruption
    # budget's: it is about this client's requests, not about the pod.
    throttled: bool = False

    @property
    def refused(self) -> bool:
        """The API answered that it evicted nothing (429, 409): no pod was disrupted."""
        return self.status in (HTTP_TOO_MANY_REQUESTS, HTTP_CONFLICT)


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
        pod = _who(namespace, name, uid)
        self._audit.record("eviction_requested", **pod, reason=reason, dry_run=dry_run)
        if self._rest is None:
            self._audit.record("eviction_blocked", **pod, reason="no Kubernetes API access")
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
            return await self._refused(exc, rest, namespace, name, uid, dry_run)
        except TRANSPORT as exc:
            self._audit.record("eviction_blocked", **pod, reason=f"transport: {exc}")
            return EvictionResult(EvictionOutcome.FAILED, dry_run, None, str(exc))
        self._audit.record("eviction_done", **pod, dry_run=dry_run, status=status)
        return EvictionResult(EvictionOutcome.EVICTED, dry_run, status)

    async def _refused(self, exc: ApiError, rest: Rest, namespace: str, name: str,
                       uid: str | None, dry_run: bool) -> EvictionResult:
        """What the API's refusal of an eviction means, audited."""
        pod = _who(namespace, name, uid)
        sent = status_body(exc)
        message = status_message(exc, sent)
        gone = exc.status == HTTP_NOT_FOUND
        throttled = False
        if exc.status == HTTP_CONFLICT and uid is not None:
            # A uid precondition that does not hold (a pod re-created under the name) answers
            # 409, but so do conflicts that say nothing of the pod (its disruption budget's
            # update raced another): only the pod read back tells them apart.
            try:
                current = await self._threads.run(functools.partial(
                    self._read_uid, rest, namespace, name))
            except TRANSIENT as read:
                why = f"API answered conflict, and the pod could not be read back: {describe(read)}"
            else:
                gone = current != uid
                why = f"API answered conflict, the pod is still the one asked for: {message}"
        elif exc.status == HTTP_TOO_MANY_REQUESTS:
            if _budget_refused(sent):
                why = f"disruption budget: {message}"
            else:
                # The API server's own throttling (Priority and Fairness): nothing was decided
                # about the pod, the eviction is tried again after the backoff (and not
                # before the Retry-After the throttling sent).
                throttled = True
                why = f"throttled by the API server: {message}"
        else:
            why = f"API error: {message}"
        if gone:
            self._audit.record("eviction_gone", **pod, status=exc.status)
            return EvictionResult(EvictionOutcome.GONE, dry_run, exc.status, message)
        wait = retry_after(exc.headers)
        self._audit.record("eviction_blocked", **pod, status=exc.status, reason=why,
                           **({} if wait is None else {"retry_after_s": wait}))
        outcome = EvictionOutcome.BLOCKED if exc.status == HTTP_TOO_MANY_REQUESTS \
            else EvictionOutcome.FAILED
        return EvictionResult(outcome, dry_run, exc.status, message, wait, throttled)

    def _read_uid(self, rest: Rest, namespace: str, name: str) -> str | None:
        """The uid of the pod the API has under that name; None when it has none (404). Sent
        once, under :data:`READ_BACK_TIMEOUT_S` at most."""
        try:
            found = read_json(rest.request(
                "GET", f"/api/v1/namespaces/{segment(namespace)}/pods/{segment(name)}",
                timeout=min(self._cfg.request_timeout_s, READ_BACK_TIMEOUT_S), retry=False))
        except ApiError as exc:
            if exc.status == HTTP_NOT_FOUND:
                return None
            raise
        meta = found.get("metadata") if isinstance(found, dict) else None
        uid = meta.get("uid") if isinstance(meta, dict) else None
        if not isinstance(uid, str) or not uid:
            raise ValueError("pod has no metadata.uid")
        return uid

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


def _who(namespace: str, name: str, uid: str | None) -> dict[str, str]:
    """The pod's fields in its eviction records: its uid too when the eviction names one, as
    the name alone can belong to another pod the node still knows (one deleted and created
    again under it)."""
    return {"pod": f"{namespace}/{name}"} if uid is None else {
        "pod": f"{namespace}/{name}", "pod_uid": uid}


def retry_after(headers: Mapping[str, str]) -> int | None:
    """The ``Retry-After`` of an answer in whole seconds, at most :data:`MAX_RETRY_AFTER_S`;
    None without one, or for anything but digits (an HTTP date, a fraction, a sign: the API
    server sends whole seconds, and guessing at anything else could only delay an eviction)."""
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    value = value.strip() if isinstance(value, str) else ""
    if not (value.isascii() and value.isdigit()):
        return None
    return min(int(value), MAX_RETRY_AFTER_S)


def _budget_refused(body: Mapping[str, Any] | None) -> bool:
    """A 429 from a PodDisruptionBudget: its Status (``body``) names the cause
    ``DisruptionBudget``."""
    details = body.get("details") if body is not None else None
    causes = details.get("causes") if isinstance(details, dict) else None
    return isinstance(causes, list) and any(
        isinstance(cause, dict) and cause.get("reason") == "DisruptionBudget" for cause in causes)
