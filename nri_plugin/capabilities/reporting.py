"""What every policy-backed capability does with the problems its policy reports."""

from __future__ import annotations

from collections.abc import Sequence

from hooks.errors import InvalidInput
from hooks.model import PodInfo
from nri_plugin.config.schema import Config
from reconciler.audit import AuditLog


class Reporting:
    """Audit every problem (``adjustment_skipped``); under strict handling also raise
    :class:`~hooks.errors.InvalidInput`, which the stub answers with an error."""

    capability = ""

    def __init__(self, audit: AuditLog, strict: bool) -> None:
        self._audit = audit
        self._strict = strict

    def _set_strict(self, config: Config) -> None:
        self._strict = config.plugin.strict

    def _report(self, pod: PodInfo, container: str, problems: Sequence[str]) -> None:
        for problem in problems:
            self._audit.record("adjustment_skipped", pod_uid=pod.uid, container=container,
                               reason=f"{self.capability}: {problem}")
        if problems and self._strict:
            raise InvalidInput(self.capability, problems)
