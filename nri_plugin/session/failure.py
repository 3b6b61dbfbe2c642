"""The failure policy of every NRI handler, in one place.

Fail-open by default: when capabilities raise, run past the deadline or the runtime sends
something the plugin cannot use, the answer carries what did work (possibly nothing) and an audit
record says what was left out. With ``plugin.strict = true`` the same situations answer with an
error status instead, which fails the pod or container operation on the runtime side.
"""

from __future__ import annotations

from common.audit import AuditLog
from nri_plugin.session.chain import ChainOutcome
from nri_plugin.wire.errors import RpcError
from nri_plugin.wire.status import StatusCode

CREATE_CONTAINER = "create_container"
"""Event name whose failures are reported as skipped adjustments."""


class FailurePolicy:
    """Turns a failed or incomplete event into an audit record, or into an error status.

    Events are named in lower case (``create_container``, ``synchronize``, ...).
    """

    def __init__(self, audit: AuditLog, *, strict: bool) -> None:
        self._audit = audit
        self.strict = strict

    def chain(self, event: str, outcome: ChainOutcome, *, pod_uid: str, container: str) -> None:
        """Accept ``outcome`` (audited if incomplete), or raise :class:`RpcError` when strict."""
        if outcome.complete:
            return
        problems = outcome.problems()
        if self.strict:
            code = StatusCode.DEADLINE_EXCEEDED if outcome.unfinished else StatusCode.UNKNOWN
            raise RpcError(code, f"nri-qos {event}: " + "; ".join(problems))
        for problem in problems:
            self._record(event, problem, pod_uid=pod_uid, container=container)

    def invalid_input(self, event: str, error: Exception, *, pod_uid: str = "",
                      container: str = "") -> None:
        """The request cannot be acted on: audited and answered empty, or rejected when strict."""
        reason = f"invalid input: {error}"
        if self.strict:
            raise RpcError(StatusCode.INVALID_ARGUMENT, f"nri-qos {event}: {reason}")
        self._record(event, reason, pod_uid=pod_uid, container=container)

    def unexpected(self, event: str, error: Exception, *, pod_uid: str = "",
                   container: str = "") -> None:
        """Handling the event failed outside any capability: audited and answered empty, or an error
        status when strict."""
        reason = f"{type(error).__name__}: {error}"
        if self.strict:
            raise RpcError(StatusCode.UNKNOWN, f"nri-qos {event}: {reason}")
        self._record(event, reason, pod_uid=pod_uid, container=container)

    def _record(self, event: str, reason: str, *, pod_uid: str, container: str) -> None:
        if event == CREATE_CONTAINER:
            self._audit.record("adjustment_skipped", pod_uid=pod_uid, container=container,
                               reason=reason)
        else:
            self._audit.record("event_failed", nri_event=event, reason=reason,
                               pod_uid=pod_uid, container=container)
