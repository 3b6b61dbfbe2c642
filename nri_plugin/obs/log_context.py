"""The context of the NRI event being handled, carried by every log line and audit record.

One context variable holds the event's fields as a single mapping. Binding it costs one
``ContextVar.set`` and reading it one ``get``, where binding each field as its own variable (as
``structlog.contextvars`` does) costs a lookup of every variable in the context per log line:
this runs on every CreateContainer, inside the runtime's request timeout.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_fields: ContextVar[Mapping[str, Any]] = ContextVar("nri_qos_event_fields", default=_EMPTY)


def current_fields() -> Mapping[str, Any]:
    """The fields bound in this context (empty outside any event)."""
    return _fields.get()


@contextmanager
def bound_fields(fields: Mapping[str, Any]) -> Iterator[None]:
    """Add ``fields`` to the context for the block; inner bindings win over outer ones."""
    outer = _fields.get()
    token = _fields.set({**outer, **fields} if outer else fields)
    try:
        yield
    finally:
        _fields.reset(token)


def merge_fields(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: the context's fields, under what the log call passes itself."""
    fields = _fields.get()
    if fields:
        for key, value in fields.items():
            event_dict.setdefault(key, value)
    return event_dict
