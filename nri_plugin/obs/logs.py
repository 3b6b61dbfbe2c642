"""Process-wide logging: structlog for the operational log, the audit trail beside it.

:class:`LoggingSetup` configures structlog (and routes the standard library's ``logging`` through
the same renderer): JSON lines when the stream is not a terminal or ``format = "json"``, a console
renderer otherwise; ISO-8601 UTC timestamps; level filtering; the fields bound for the event
being handled (:func:`nri_plugin.obs.log_context.bound_fields`) merged into every line, so the
handler binds them once.

Its :attr:`LoggingSetup.audit` is the production :class:`AuditLog`; :meth:`LoggingSetup.apply`
re-applies a (reloaded) ``[logging]`` section without replacing that object, so components keep
the audit log they were given.

The message key is structlog's ``event``: never pass ``event=`` to a log call (use ``nri_event``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, TextIO, cast

import structlog
from structlog.typing import Processor

from common.audit import AUDIT_LOGGER, AuditLog
from hooks.config_fields import setting
from nri_plugin.obs.audit_sinks import AuditFile, LogAuditSink, json_text
from nri_plugin.obs.log_context import merge_fields

LEVELS: Mapping[str, int] = {
    "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
    "error": logging.ERROR,
}
LOGS_LOGGER = "nri_qos.logs"


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    level: str = setting(
        "info", "Log level of the operational log.",
        choices=("debug", "info", "warning", "error"),
    )
    format: str = setting(
        "auto", "auto: JSON when stderr is not a terminal, console otherwise.",
        choices=("auto", "json", "console"),
    )
    audit_file: str = setting(
        "", "Also write audit records (JSON lines) to this file; empty means the log stream only."
    )
    audit_max_bytes: int = setting(
        16 << 20, "Rotate the audit file when it reaches this size.", unit="bytes",
        minimum=4096, maximum=1 << 40,
    )
    audit_backups: int = setting(
        5, "Rotated audit files kept.", minimum=0, maximum=1000,
    )


class _NamedWriteLogger(structlog.WriteLogger):
    """A WriteLogger that remembers the name given to ``structlog.get_logger(name)``."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


def _add_logger_name(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    name = getattr(logger, "name", "")
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


_LEAD_KEYS = ("timestamp", "level", "logger", "event")


def _lead_keys(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Put timestamp, level, logger and event first, so lines read alike."""
    lead = {k: event_dict.pop(k) for k in _LEAD_KEYS if k in event_dict}
    lead.update(event_dict)
    return lead


class _RootHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler a :class:`LoggingSetup` puts on the root logger (recognised by its type)."""


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of writing, not at setup time (it may be
    replaced later, e.g. by a test runner capturing output)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def wants_json(fmt: str, stream: TextIO) -> bool:
    if fmt == "json":
        return True
    if fmt == "console":
        return False
    isatty = getattr(stream, "isatty", None)
    return not (callable(isatty) and isatty())


class LoggingSetup:
    """structlog configured for this process, plus the production audit log.

    ``level`` (from ``--log-level``) overrides ``cfg.level`` for the life of the object, reloads
    included. structlog's configuration is global by nature; this object is the one place that
    sets it, and :meth:`close` undoes what it added to the standard library's root logger.
    """

    def __init__(self, cfg: LoggingConfig | None = None, *, level: str | None = None,
                 stream: TextIO | None = None) -> None:
        if level is not None and level not in LEVELS:
            raise ValueError(f"unknown log level {level!r} (use {', '.join(LEVELS)})")
        self._level_override = level
        self._stream: TextIO = stream if stream is not None else cast(TextIO, _CurrentStderr())
        self._handler: logging.Handler | None = None
        self._root_level = logging.getLogger().level
        self._file_key: tuple[str, int, int] | None = None
        self.sink = LogAuditSink(structlog.get_logger(AUDIT_LOGGER),
                                 structlog.get_logger(LOGS_LOGGER))
        self.audit = AuditLog(self.sink)
        self.apply(cfg if cfg is not None else LoggingConfig())

    @property
    def level(self) -> str:
        return self._level_override or self.cfg.level

    def apply(self, cfg: LoggingConfig) -> None:
        """(Re)configure logging from ``cfg``; safe to call on every configuration reload."""
        self.cfg = cfg
        stream = self._stream
        json_lines = wants_json(cfg.format, stream)
        renderer: Processor
        if json_lines:
            renderer = structlog.processors.JSONRenderer(serializer=json_text)
        else:
            isatty = getattr(stream, "isatty", None)
            renderer = structlog.dev.ConsoleRenderer(colors=callable(isatty) and bool(isatty()))
        tail: list[Processor] = (
            [structlog.processors.dict_tracebacks, _lead_keys, renderer] if json_lines
            else [renderer]
        )
        structlog.configure(
            processors=[
                merge_fields,
                structlog.processors.add_log_level,
                _add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.StackInfoRenderer(),
                *tail,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(LEVELS[self.level]),
            logger_factory=lambda *args: _NamedWriteLogger(stream, str(args[0]) if args else ""),
            # Loggers are looked up anew on each use so a reload's level and format apply.
            cache_logger_on_first_use=False,
        )
        self._route_stdlib(renderer)
        # Audit lines bypass the level filter: the trail is not chatter. The sink adds the
        # timestamp so the log line and the file line agree.
        # Bound once here, not per record: the lazy proxy would build a logger on every call.
        audit_stream = structlog.wrap_logger(
            structlog.WriteLogger(stream),
            processors=[merge_fields, _lead_keys, renderer],
            wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
        ).bind()
        errors = structlog.get_logger(LOGS_LOGGER)
        self.sink.set_stream(audit_stream, errors)
        self._apply_file(cfg, errors)

    def retry_file(self) -> None:
        """A configuration was loaded, changed or not: an audit file that could not be opened
        is tried again."""
        if self._file_key is None and self.cfg.audit_file:
            self._apply_file(self.cfg, structlog.get_logger(LOGS_LOGGER))

    def _route_stdlib(self, renderer: Processor) -> None:
        root = logging.getLogger()
        # One setup is in force per process: a new one replaces any earlier one's handler.
        for old in [h for h in root.handlers if isinstance(h, _RootHandler)]:
            root.removeHandler(old)
        handler = _RootHandler(self._stream)
        handler.setFormatter(structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                merge_fields,
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _lead_keys,
                        renderer],
        ))
        root.addHandler(handler)
        root.setLevel(LEVELS[self.level])
        self._handler = handler

    def _apply_file(self, cfg: LoggingConfig, errors: Any) -> None:
        key = (cfg.audit_file, cfg.audit_max_bytes, cfg.audit_backups)
        if key == self._file_key:
            return
        self._file_key = key
        if not cfg.audit_file:
            self.sink.set_file(None)
            return
        try:
            file = AuditFile(cfg.audit_file, cfg.audit_max_bytes, cfg.audit_backups)
        except OSError as exc:
            # Fail open: the records still reach the log stream. Not remembered as applied:
            # the next load tries again (the directory made meanwhile, then a SIGHUP).
            self._file_key = None
            self.sink.set_file(None)
            errors.error("audit_file_unavailable", path=cfg.audit_file,
                         error=exc.strerror or str(exc),
                         hint="audit records go to the log stream only")
            return
        self.sink.set_file(file)

    def close(self) -> None:
        """Undo the setup: close the audit file, detach from the standard library's root logger
        and put structlog back to its defaults (so a process, or a test, can set up anew)."""
        self.sink.set_file(None)
        self._file_key = None
        root = logging.getLogger()
        if self._handler is not None:
            root.removeHandler(self._handler)
            self._handler = None
        root.setLevel(self._root_level)
        structlog.reset_defaults()
