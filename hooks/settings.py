"""A container's desired settings, and the one place where several policies' answers are merged.

Each policy returns a :class:`ContainerSettings` holding only what it decides (``None``/empty means
"no opinion"). :func:`merge` combines them in chain order: the first policy to set a field owns it,
a later different value is dropped and reported as a :class:`Conflict` (equal values are not a
conflict). OCI hooks are appended, as the runtime does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import cast

from hooks.model import EMPTY_MAP


class HookStage(StrEnum):
    """OCI lifecycle hook points, named as in the runtime spec."""

    PRESTART = "prestart"
    CREATE_RUNTIME = "create_runtime"
    CREATE_CONTAINER = "create_container"
    START_CONTAINER = "start_container"
    POSTSTART = "poststart"
    POSTSTOP = "poststop"


@dataclass(frozen=True, slots=True)
class OciHookSpec:
    stage: HookStage
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    # seconds; None means no timeout
    timeout_s: int | None = None


@dataclass(frozen=True, slots=True)
class ContainerSettings:
    # resctrl group (CLOS) name the container belongs in
    rdt_class: str | None = None
    # cgroup v2 files, e.g. {"memory.high": "483183820"}
    unified: Mapping[str, str] = field(default_factory=lambda: EMPTY_MAP)
    # cgroup v1 memory.limit_in_bytes / memory.soft_limit_in_bytes, in bytes
    memory_limit: int | None = None
    memory_reservation: int | None = None
    oom_score_adj: int | None = None
    hooks: tuple[OciHookSpec, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=lambda: EMPTY_MAP)

    def is_empty(self) -> bool:
        return self == EMPTY_SETTINGS


EMPTY_SETTINGS = ContainerSettings()

_SCALARS = ("rdt_class", "memory_limit", "memory_reservation", "oom_score_adj")
_MAPS = ("unified", "annotations")


@dataclass(frozen=True, slots=True)
class Conflict:
    """Two policies asked for different values of one field; ``kept`` won."""

    field: str
    owner: str
    kept: object
    rejected_by: str
    rejected: object


@dataclass(frozen=True, slots=True)
class MergeResult:
    settings: ContainerSettings
    conflicts: tuple[Conflict, ...]
    # field (or "unified.<key>") -> name of the policy that set it
    owners: Mapping[str, str]


def merge(parts: Sequence[tuple[str, ContainerSettings]]) -> MergeResult:
    """Merge ``(policy name, settings)`` pairs in order; first owner wins."""
    # Runs on every CreateContainer: plain dicts and loops, no per-field helper calls.
    values: dict[str, object] = {}
    owners: dict[str, str] = {}  # field, or "<map>.<key>" for map entries -> owner
    maps: dict[str, dict[str, str]] = {name: {} for name in _MAPS}
    conflicts: list[Conflict] = []
    hooks: list[OciHookSpec] = []
    for owner, part in parts:
        if part is EMPTY_SETTINGS:
            continue
        for name in _SCALARS:
            value = getattr(part, name)
            if value is None:
                continue
            if name not in owners:
                owners[name] = owner
                values[name] = value
            elif values[name] != value:
                conflicts.append(Conflict(name, owners[name], values[name], owner, value))
        for name in _MAPS:
            entries: Mapping[str, str] = getattr(part, name)
            if not entries:
                continue
            merged = maps[name]
            for key, value in entries.items():
                held = merged.get(key)
                if held is None:
                    merged[key] = value
                    owners[f"{name}.{key}"] = owner
                elif held != value:
                    conflicts.append(Conflict(f"{name}.{key}", owners[f"{name}.{key}"], held,
                                              owner, value))
        hooks.extend(part.hooks)

    if not owners and not hooks:
        return MergeResult(EMPTY_SETTINGS, tuple(conflicts), MappingProxyType({}))
    settings = ContainerSettings(
        rdt_class=cast("str | None", values.get("rdt_class")),
        memory_limit=cast("int | None", values.get("memory_limit")),
        memory_reservation=cast("int | None", values.get("memory_reservation")),
        oom_score_adj=cast("int | None", values.get("oom_score_adj")),
        unified=MappingProxyType(maps["unified"]) if maps["unified"] else EMPTY_MAP,
        annotations=MappingProxyType(maps["annotations"]) if maps["annotations"] else EMPTY_MAP,
        hooks=tuple(hooks),
    )
    return MergeResult(settings, tuple(conflicts), MappingProxyType(owners))
