"""The audit trail: a fixed catalogue of event names, each with its required fields.

Audit records go through their own logger (``nri_qos.audit``, every line marked ``audit=true``)
and, optionally, to a JSON-lines file rotated by size (:class:`AuditFile`). A record whose name is
not in :data:`CATALOGUE`, that lacks a required field or that uses a field name the record itself
needs (:data:`RESERVED_FIELDS`), is a programming error and raises, so the catalogue and the code
cannot drift apart. ``docs/audit.md`` documents the catalogue; a test keeps the two in sync.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Protocol

import orjson

from nri_plugin.log_context import current_fields

AUDIT_LOGGER = "nri_qos.audit"
# Keys every audit line carries itself; a record's fields must not use them.
RESERVED_FIELDS = frozenset({"event", "timestamp", "logger", "audit", "level"})


@dataclass(frozen=True, slots=True)
class AuditEvent:
    name: str
    required: tuple[str, ...]
    description: str


def _catalogue(*events: AuditEvent) -> Mapping[str, AuditEvent]:
    return MappingProxyType({e.name: e for e in events})


CATALOGUE: Mapping[str, AuditEvent] = _catalogue(
    AuditEvent("config_loaded", ("source",), "A configuration was validated and took effect."),
    AuditEvent("config_rejected", ("source", "errors"),
               "A configuration was invalid; the previous one stays in force."),
    AuditEvent("adjustment_applied", ("pod_uid", "container", "qos_level", "fields"),
               "A CreateContainer answer carried these settings."),
    AuditEvent("adjustment_skipped", ("pod_uid", "container", "reason"),
               "A setting was left out (invalid input, missing feature, deadline, error)."),
    AuditEvent("adjustment_conflict", ("pod_uid", "container", "field", "kept_owner",
                                       "rejected_owner"),
               "Two capabilities asked for different values of one field."),
    AuditEvent("event_failed", ("nri_event", "reason"),
               "An NRI event handler failed; the answer was empty, partial or an error."),
    AuditEvent("cgroup_write", ("path", "value", "reason"), "A cgroup or procfs file was written."),
    AuditEvent("cgroup_write_failed", ("path", "value", "reason", "error"),
               "A write failed after its retries."),
    AuditEvent("resctrl_group_created", ("group", "schemata", "reason"),
               "A resctrl control group was created or its schemata rewritten."),
    AuditEvent("resctrl_group_removed", ("group", "reason"), "A resctrl group was removed."),
    AuditEvent("resctrl_fallback", ("pod_uid", "group", "reason"),
               "A pod-level group could not be had; the level's class group is used."),
    AuditEvent("tasks_moved", ("group", "count"), "Task ids were written into a resctrl group."),
    AuditEvent("memory_guard_cap", ("path", "cap_bytes", "previous_bytes"),
               "The reclaimed tier's memory cap changed."),
    AuditEvent("numa_binding", ("pod_uid", "container", "mems", "reason"),
               "A container's cpuset.mems was changed."),
    AuditEvent("drop_cache_started", ("path", "reason"), "A drop-cache action started."),
    AuditEvent("drop_cache_finished", ("path", "duration_s", "result"),
               "A drop-cache action ended."),
    AuditEvent("eviction_requested", ("pod", "reason", "dry_run"), "An eviction was asked for."),
    AuditEvent("eviction_blocked", ("pod", "reason"),
               "The API refused an eviction (e.g. 429 from a PodDisruptionBudget)."),
    AuditEvent("eviction_done", ("pod",), "The API accepted an eviction."),
    AuditEvent("taint_added", ("node", "taint", "reason"), "A node taint was added."),
    AuditEvent("taint_removed", ("node", "taint", "reason"), "A node taint was removed."),
)


class AuditSink(Protocol):
    def __call__(self, event: str, fields: Mapping[str, Any]) -> None: ...


class AuditLog:
    """Checks records against the catalogue and hands them to a sink (structlog in production)."""

    def __init__(self, sink: AuditSink) -> None:
        self._sink = sink

    def record(self, event: str, /, **fields: Any) -> None:
        spec = CATALOGUE.get(event)
        if spec is None:
            raise ValueError(f"audit event {event!r} is not in the catalogue")
        missing = [name for name in spec.required if name not in fields]
        if missing:
            raise ValueError(f"audit event {event!r} lacks required fields: {', '.join(missing)}")
        reserved = sorted(RESERVED_FIELDS.intersection(fields))
        if reserved:
            raise ValueError(f"audit event {event!r} uses reserved field names: "
                             f"{', '.join(reserved)}")
        self._sink(event, fields)


class MemoryAuditSink:
    """Keeps records in a list; for tests and the simulator's report."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None:
        self.records.append((event, dict(fields)))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.records if name == event]


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
    :func:`nri_plugin.logs.configure_logging` does the wiring. A failing audit file never fails
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
        stream.info(event, timestamp=timestamp, logger=AUDIT_LOGGER, audit=True, **fields)
        if file is None:
            return
        line: dict[str, Any] = {"timestamp": timestamp, "logger": AUDIT_LOGGER, "audit": True,
                                "event": event}
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
