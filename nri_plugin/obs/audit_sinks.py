"""Where audit records go: the log stream and, optionally, a JSON-lines file rotated by size.

Audit records go through their own logger (``nri_qos.audit``, every line marked ``audit=true``)
and, when ``logging.audit_file`` is set, to :class:`AuditFile`. The catalogue of records lives
with :class:`common.audit.AuditLog`, which hands each checked record to one of these sinks.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

import orjson

from common.audit import AUDIT_LOGGER, level_of
from nri_plugin.obs.log_context import current_fields


def json_default(value: Any) -> Any:
    """JSON form of the values records carry besides plain JSON types."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def json_text(value: Any, **_: Any) -> str:
    """One log line or audit record as JSON text (structlog's ``serializer`` signature).

    orjson renders these small records about ten times faster than the standard library, which
    matters on every NRI event; what orjson refuses (an integer beyond 64 bits, a string with
    lone surrogates) goes through the standard library, escaped to ASCII, so no line is lost.
    """
    try:
        return orjson.dumps(value, default=json_default, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(value, default=json_default)


class AuditFile:
    """Appends JSON lines to ``path`` and rotates it by size, like ``RotatingFileHandler``.

    Before a line would take the file past ``max_bytes`` the file is renamed to ``path.1`` (older
    copies shift to ``path.2`` ... ``path.<backups>``, the oldest is deleted) and a new file is
    started; with ``backups = 0`` the file is truncated instead. A line longer than
    ``max_bytes`` still goes, alone, into a fresh file. Thread-safe.

    Not ``logging.handlers.RotatingFileHandler`` itself, which differs where the audit trail
    needs this behaviour (measured on Python 3.11; a test of this class pins each difference):
    with ``backupCount=0`` it never rolls over, so the file grows without bound (five 27-byte
    lines under a 60-byte limit left a 135-byte file, where this one truncates); a first line
    longer than the limit rotates the empty file into an empty ``.1`` that pushes a real backup
    out; it rolls over when a line would bring the file *to* the limit, not past it; and a
    failed write goes to ``handleError`` (a traceback on stderr per record) instead of raising,
    so :class:`LogAuditSink` could not report ``audit_file_write_failed`` once per failure streak.
    """

    def __init__(self, path: str, max_bytes: int, backups: int) -> None:
        if max_bytes <= 0 or backups < 0:
            raise ValueError("max_bytes must be positive and backups not negative")
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self._file = open(path, "ab")  # noqa: SIM115 - kept open across writes, closed by close()
        self._size = self._file.tell()

    def write(self, record: Mapping[str, Any]) -> None:
        line = (json_text(record) + "\n").encode()
        with self._lock:
            if self._size > 0 and self._size + len(line) > self.max_bytes:
                self._rotate()
            self._file.write(line)
            self._file.flush()
            self._size += len(line)

    def _rotate(self) -> None:
        self._file.close()
        if self.backups > 0:
            # A file removed under us (by hand, by a log shipper) has nothing to keep: a new
            # one is started and the backups stay, or every rotation would fail and shift them
            # out.
            if os.path.exists(self.path):
                for i in range(self.backups - 1, 0, -1):
                    older = f"{self.path}.{i}"
                    if os.path.exists(older):
                        os.replace(older, f"{self.path}.{i + 1}")
                os.replace(self.path, f"{self.path}.1")
            self._file = open(self.path, "ab")  # noqa: SIM115
        else:
            self._file = open(self.path, "wb")  # noqa: SIM115
        self._size = 0

    def close(self) -> None:
        with self._lock:
            self._file.close()


class StreamLogger(Protocol):
    def info(self, event: str, **fields: Any) -> Any: ...

    def error(self, event: str, **fields: Any) -> Any: ...


class LogAuditSink:
    """The production sink: one line on the audit logger and, if configured, one in the file.

    The log stream and the file can be swapped while records flow (a reloaded configuration);
    :class:`nri_plugin.obs.logs.LoggingSetup` does the wiring. A failing audit file never fails
    the caller: the error goes to ``errors`` (the operational log) once per failure streak.
    """

    def __init__(self, stream: StreamLogger, errors: StreamLogger,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._stream = stream
        self._errors = errors
        self._file: AuditFile | None = None
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._failing = False

    def set_stream(self, stream: StreamLogger, errors: StreamLogger) -> None:
        with self._lock:
            self._stream, self._errors = stream, errors

    def set_file(self, file: AuditFile | None) -> None:
        """Write to ``file`` from now on (None: the log stream only); closes the previous one."""
        with self._lock:
            old, self._file = self._file, file
            self._failing = False
        if old is not None and old is not file:
            old.close()

    @property
    def file(self) -> AuditFile | None:
        return self._file

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None:
        timestamp = datetime.fromtimestamp(self._wall_clock(), UTC).isoformat().replace(
            "+00:00", "Z")
        with self._lock:
            stream, errors, file = self._stream, self._errors, self._file
        level = level_of(event)
        stream.info(event, timestamp=timestamp, level=level, logger=AUDIT_LOGGER, audit=True,
                    **fields)
        if file is None:
            return
        line: dict[str, Any] = {"timestamp": timestamp, "level": level, "logger": AUDIT_LOGGER,
                                "audit": True, "event": event}
        for key, value in current_fields().items():
            line.setdefault(key, value)
        line.update(fields)
        try:
            file.write(line)
        except (OSError, ValueError) as exc:  # ValueError: written after close by a swap
            if not self._failing:
                self._failing = True
                errors.error("audit_file_write_failed", path=file.path, error=str(exc))
        else:
            self._failing = False
