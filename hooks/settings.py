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
    scalars: dict[str, object] = {}
    maps: dict[str, dict[str, str]] = {name: {} for name in _MAPS}
    owners: dict[str, str] = {}
    conflicts: list[Conflict] = []
    hooks: list[OciHookSpec] = []

    def claim(key: str, value: object, owner: str, store: dict[str, object]) -> None:
        if key not in owners:
            owners[key] = owner
            store[key] = value
        elif store[key] != value:
            conflicts.append(Conflict(key, owners[key], store[key], owner, value))

    for owner, part in parts:
        for name in _SCALARS:
            value = getattr(part, name)
            if value is not None:
                claim(name, value, owner, scalars)
        for name in _MAPS:
            entries: Mapping[str, str] = getattr(part, name)
            store = maps[name]
            for key, value in entries.items():
                claim(f"{name}.{key}", value, owner, store)  # type: ignore[arg-type]
        hooks.extend(part.hooks)

    settings = ContainerSettings(
        rdt_class=scalars.get("rdt_class"),  # type: ignore[arg-type]
        memory_limit=scalars.get("memory_limit"),  # type: ignore[arg-type]
        memory_reservation=scalars.get("memory_reservation"),  # type: ignore[arg-type]
        oom_score_adj=scalars.get("oom_score_adj"),  # type: ignore[arg-type]
        unified=_strip("unified.", maps["unified"]),
        annotations=_strip("annotations.", maps["annotations"]),
        hooks=tuple(hooks),
    )
    return MergeResult(settings, tuple(conflicts), MappingProxyType(owners))


def _strip(prefix: str, entries: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType({k.removeprefix(prefix): v for k, v in entries.items()})
