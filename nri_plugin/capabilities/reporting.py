"""What every policy-backed capability does with the problems its policy reports."""

from __future__ import annotations

from collections.abc import Sequence

from common.audit import AuditLog
from hooks.errors import InvalidInput
from hooks.model import PodInfo
from hooks.untrusted import bounded
from nri_plugin.config.schema import Config

MAX_REASON_CHARS = 1024
"""The longest reason of one record: a few dozen problems, each already bounded by its policy."""


class Reporting:
    """Audit the problems of one decision in one record (``adjustment_skipped``); under strict
    handling also raise :class:`~hooks.errors.InvalidInput`, which the stub answers with an
    error.

    One record, not one per problem: an annotation is the pod's to write, and one of a few KiB
    can hold hundreds of problems; each of its events must cost the audit trail one line."""

    capability = ""

    def __init__(self, audit: AuditLog, strict: bool) -> None:
        self._audit = audit
        self._strict = strict

    def _set_strict(self, config: Config) -> None:
        self._strict = config.plugin.strict

    def _report(self, pod: PodInfo, container: str, problems: Sequence[str]) -> None:
        if not problems:
            return
        reason = f"{self.capability}: " + "; ".join(problems)
        self._audit.record("adjustment_skipped", pod_uid=bounded(pod.uid),
                           container=bounded(container),
                           reason=bounded(reason, MAX_REASON_CHARS))
        if self._strict:
            raise InvalidInput(self.capability, problems)
