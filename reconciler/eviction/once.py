"""Audit records of decisions that repeat every round, written when the decision starts."""

from __future__ import annotations

from common.audit import AuditLog


class RoundAudit:
    """Records an event unless the same decision was recorded in the previous round too: a
    pod proposed every second is audited when it starts being proposed, and again only after
    a round without it."""

    def __init__(self, audit: AuditLog) -> None:
        self._audit = audit
        self._said: set[tuple[str, ...]] = set()
        self._seen: set[tuple[str, ...]] = set()

    def start_round(self) -> None:
        self._seen = set()

    def end_round(self) -> None:
        """Forget what this round did not decide again."""
        self._said &= self._seen

    def record(self, event: str, *key: str, **fields: object) -> None:
        """``key`` names the decision (with ``event``); ``fields`` are the record's."""
        ident = (event, *key)
        self._seen.add(ident)
        if ident in self._said:
            return
        self._said.add(ident)
        self._audit.record(event, **fields)
