"""Declaring configuration settings: a default, a documentation line, a unit and a valid range.

Every setting of the node configuration is a dataclass field built with :func:`setting` or
:func:`section`, declared beside the policy or loop that reads it. The metadata drives both the
validation and the commented default file of the configuration loader, so documentation and checks
cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

META_KEY = "nri_qos"


@dataclasses.dataclass(frozen=True, slots=True)
class SettingMeta:
    """What the loader and the renderer know about one setting."""

    doc: str
    unit: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    # For mappings: the keys a table may hold (None means any key that is a valid name).
    keys: tuple[str, ...] | None = None
    # Extra check run after type conversion; returns an error text or None.
    check: Callable[[Any], str | None] | None = None


def setting(
    default: Any,
    doc: str,
    *,
    unit: str | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] | None = None,
    keys: tuple[str, ...] | None = None,
    check: Callable[[Any], str | None] | None = None,
) -> Any:
    """A leaf setting (or a mapping/tuple of them) with an immutable default."""
    meta = SettingMeta(doc, unit, minimum, maximum, choices, keys, check)
    if isinstance(default, Mapping):
        frozen = MappingProxyType(dict(default))
        return dataclasses.field(
            default_factory=lambda: frozen, metadata={META_KEY: meta}
        )
    return dataclasses.field(default=default, metadata={META_KEY: meta})


def section(factory: Callable[[], Any], doc: str) -> Any:
    """A nested table whose defaults come from its own dataclass."""
    return dataclasses.field(default_factory=factory, metadata={META_KEY: SettingMeta(doc)})


def frozen_map(entries: Mapping[str, Any]) -> Mapping[str, Any]:
    """An immutable mapping, for defaults and loaded values alike."""
    return MappingProxyType(dict(entries))


def meta_of(f: dataclasses.Field[Any]) -> SettingMeta:
    meta = f.metadata.get(META_KEY)
    if not isinstance(meta, SettingMeta):
        raise TypeError(f"config field {f.name!r} is not declared with setting() or section()")
    return meta


def percent(default: int, doc: str) -> Any:
    """An integer percentage, 0..100."""
    return setting(default, doc, unit="percent", minimum=0, maximum=100)
