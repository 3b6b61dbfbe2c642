"""The canonical event line (``nri_event``, one per request) and the request metrics beside it.

Events and Synchronize both write it; the line goes through a logger bound once per logging
configuration, and every request is counted once, under the metrics' name for its result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from common.metrics import PluginMetrics
from nri_plugin.config.schema import Config

log = structlog.get_logger("nri_qos.nri")

METRIC_RESULT = {"ok": "ok", "partial": "fail-open", "invalid": "fail-open", "error": "error"}
"""The event line's result -> the metrics' result (an "error" answered empty is "fail-open")."""


class EventLog:
    """Writes the ``nri_event`` line and counts the request in ``metrics`` (when there are any)."""

    def __init__(self, config: Callable[[], Config], metrics: PluginMetrics | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._log_config: object = None
        self._bound_log: Any = log

    def line(self) -> Any:
        """The logger of the canonical event line, bound once per logging configuration.

        structlog's lazy proxy builds a new logger on every call; binding it once saves that,
        and rebinding when the logging section changes picks up a reloaded configuration.
        """
        logging_cfg = self._config().logging
        if logging_cfg != self._log_config:
            self._log_config = logging_cfg
            self._bound_log = log.bind()
        return self._bound_log

    def count(self, name: str, result: str, seconds: float) -> None:
        """Count one request of ``name`` with the metrics' ``result``."""
        if self._metrics is not None:
            self._metrics.nri_request(name, result, seconds)

    def count_since(self, name: str, result: str, started: float) -> None:
        """Count one request that started at ``started`` (on the clock given at construction)."""
        self.count(name, result, self._clock() - started)

    def done(self, metric_result: str, seconds: float, **fields: Any) -> None:
        """Write an event's line and count it (``fields`` name the event as ``nri_event``)."""
        self.line().info("nri_event", **fields)
        self.count(fields["nri_event"], metric_result, seconds)
