"""Changes of this node's object: its taints and its status conditions.

Each is a read-modify-write guarded by the node's resourceVersion, so that a change by someone
else in between (kubelet's heartbeat, another controller's taint) is never overwritten: a 409
rereads and retries.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from common.audit import AuditLog
from reconciler.kube.client import finish, read_json, resource_version, rfc3339_now
from reconciler.kube.config import KubernetesConfig
from reconciler.kube.errors import HTTP_CONFLICT, TRANSIENT, ApiError, describe
from reconciler.kube.rest import MERGE_PATCH, Rest, segment
from reconciler.kube.threads import ApiThreads

log = structlog.get_logger("nri_qos.kube")

TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# Attempts of a read-modify-write of the node (taints, conditions) that keeps losing to other
# writers.
NODE_UPDATE_ATTEMPTS = 5

Taints = list[dict[str, Any]]


class NodeOutcome(enum.StrEnum):
    """How a change of the node (a taint, a status condition) went."""

    CHANGED = "changed"
    UNCHANGED = "unchanged"  # already as asked: nothing was written
    FAILED = "failed"
    UNAVAILABLE = "unavailable"


class NodeWriter:
    """Taints (audited here) and conditions (audited by their owner); ``rest`` None: degraded,
    every change reports ``unavailable``."""

    def __init__(self, rest: Rest | None, cfg: KubernetesConfig, audit: AuditLog,
                 threads: ApiThreads) -> None:
        self._rest = rest
        self._cfg = cfg
        self._audit = audit
        self._threads = threads

    async def add_taint(
        self, node: str, key: str, value: str, effect: str, *, reason: str = "unspecified"
    ) -> NodeOutcome:
        """See :meth:`reconciler.kube.actions.KubeActions.add_taint`."""
        if effect not in TAINT_EFFECTS:
            raise ValueError(f"taint effect must be one of {', '.join(TAINT_EFFECTS)}: {effect!r}")
        wanted = {"key": key, "value": value, "effect": effect} if value else {
            "key": key, "effect": effect
        }

        def change(taints: Taints) -> Taints | None:
            same = [t for t in taints if t.get("key") == key and t.get("effect") == effect]
            if [_taint_text(t) for t in same] == [_taint_text(wanted)]:
                return None
            return [t for t in taints if t not in same] + [wanted]

        outcome, _ = await self._update_taints(node, change)
        if outcome is NodeOutcome.CHANGED:
            self._audit.record("taint_added", node=node, taint=_taint_text(wanted), reason=reason)
        return outcome

    async def remove_taint(
        self, node: str, key: str, *, reason: str = "unspecified"
    ) -> NodeOutcome:
        """See :meth:`reconciler.kube.actions.KubeActions.remove_taint`."""

        def change(taints: Taints) -> Taints | None:
            kept = [t for t in taints if t.get("key") != key]
            return None if len(kept) == len(taints) else kept

        outcome, removed = await self._update_taints(node, change)
        for taint in removed:
            self._audit.record("taint_removed", node=node, taint=_taint_text(taint), reason=reason)
        return outcome

    async def _update_taints(
        self, node: str, change: Callable[[Taints], Taints | None]
    ) -> tuple[NodeOutcome, Taints]:
        """Read-modify-write of ``spec.taints``; returns the outcome and the taints that were
        dropped."""
        dropped: Taints = []

        def patch(current: dict[str, Any]) -> dict[str, Any] | None:
            spec = current.get("spec")
            raw = spec.get("taints") if isinstance(spec, dict) else None
            taints = [t for t in raw if isinstance(t, dict)] if isinstance(raw, list) else []
            updated = change(taints)
            if updated is None:
                return None
            dropped[:] = [t for t in taints if t not in updated]
            return {"spec": {"taints": updated}}

        outcome = await self._update_node(node, patch, status=False, what="taint")
        return outcome, dropped if outcome is NodeOutcome.CHANGED else []

    async def set_node_condition(
        self, node: str, condition: str, status: bool, reason: str, message: str
    ) -> NodeOutcome:
        """See :meth:`reconciler.kube.actions.KubeActions.set_node_condition`."""
        text = "True" if status else "False"

        def patch(current: dict[str, Any]) -> dict[str, Any] | None:
            conditions = _conditions(current)
            mine = next((c for c in conditions if c.get("type") == condition), None)
            # Status and reason, not the message: a message carrying the observed value would
            # otherwise rewrite the node at every change of that value.
            if mine is not None and (mine.get("status"), mine.get("reason")) == (text, reason):
                return None
            now = rfc3339_now()
            transition = now if mine is None or mine.get("status") != text else \
                mine.get("lastTransitionTime", now)
            wanted = {"type": condition, "status": text, "reason": reason, "message": message,
                      "lastHeartbeatTime": now, "lastTransitionTime": transition}
            # A merge patch replaces the whole list: every other condition is written back as
            # read, and the resourceVersion precondition makes sure nothing changed meanwhile.
            kept = [c for c in conditions if c.get("type") != condition]
            return {"status": {"conditions": [*kept, wanted]}}

        return await self._update_node(node, patch, status=True, what="condition")

    async def remove_node_condition(self, node: str, condition: str) -> NodeOutcome:
        """See :meth:`reconciler.kube.actions.KubeActions.remove_node_condition`."""

        def patch(current: dict[str, Any]) -> dict[str, Any] | None:
            conditions = _conditions(current)
            kept = [c for c in conditions if c.get("type") != condition]
            if len(kept) == len(conditions):
                return None
            return {"status": {"conditions": kept}}

        return await self._update_node(node, patch, status=True, what="condition")

    async def _update_node(
        self, node: str, patch_for: Callable[[dict[str, Any]], dict[str, Any] | None], *,
        status: bool, what: str,
    ) -> NodeOutcome:
        """Read-modify-write of the node (``status``: through its status subresource) guarded by
        its resourceVersion. ``patch_for`` gets the node as read and returns the merge patch to
        apply, or None when nothing is to change. A 409 (someone else updated the node in
        between) rereads and retries."""
        if self._rest is None:
            log.warning(f"{what}_skipped", node=node, reason="no Kubernetes API access")
            return NodeOutcome.UNAVAILABLE
        rest = self._rest
        timeout = self._cfg.request_timeout_s
        path = f"/api/v1/nodes/{segment(node)}"

        def attempt() -> NodeOutcome | None:
            current = read_json(rest.request("GET", path, timeout=timeout))
            if not isinstance(current, dict):
                raise ValueError("node is not a JSON object")
            patch = patch_for(current)
            if patch is None:
                return NodeOutcome.UNCHANGED
            version = resource_version(current)
            if not version:
                # An empty precondition is none: the write would replace whatever another
                # writer (kubelet's heartbeat) put there in between.
                raise ValueError("node has no metadata.resourceVersion")
            patch["metadata"] = {"resourceVersion": version}
            try:
                written = rest.request("PATCH", f"{path}/status" if status else path,
                                       body=patch, content_type=MERGE_PATCH, timeout=timeout)
            except ApiError as exc:
                if exc.status == HTTP_CONFLICT:
                    return None
                raise
            finish(written)
            return NodeOutcome.CHANGED

        for _ in range(NODE_UPDATE_ATTEMPTS):
            try:
                result = await self._threads.run(attempt)
            except TRANSIENT as exc:
                log.warning(f"{what}_failed", node=node, reason=describe(exc))
                return NodeOutcome.FAILED
            if result is not None:
                return result
            log.info(f"{what}_conflict", node=node, detail="node changed meanwhile; retrying")
        log.warning(f"{what}_failed", node=node, reason="resourceVersion conflicts persisted")
        return NodeOutcome.FAILED


def _conditions(node: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``status.conditions`` of the node as read, without entries that are not objects."""
    found = node.get("status")
    raw = found.get("conditions") if isinstance(found, dict) else None
    return [c for c in raw if isinstance(c, dict)] if isinstance(raw, list) else []


def _taint_text(taint: Mapping[str, Any]) -> str:
    value = taint.get("value")
    return f"{taint.get('key')}{'=' + str(value) if value else ''}:{taint.get('effect')}"
