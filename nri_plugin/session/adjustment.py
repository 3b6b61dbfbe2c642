"""The CreateContainer answer: the capabilities' parts merged, kept to what gets applied.

:func:`decide` is pure: it merges the parts (first owner wins, conflicts reported), and sorts each
field the policies asked for into one of three routes:

* the **adjustment**, when the runtime applies the field (:mod:`nri_plugin.wire.runtime_support`);
* the **reconciler**, when the runtime would drop it but a background loop applies it to the
  running container (oom_score_adj and memcg values by the drift loop, the resctrl group by the
  task-id loop): left out of the answer, the value still reaches the container right after it
  starts;
* **nowhere**: neither applies it (say, OCI hooks on a runtime without them): left out and
  reported.

:func:`encode` turns the decision into the response bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hooks.settings import EMPTY_SETTINGS, Conflict, ContainerSettings, merge
from nri_plugin.wire.convert import fill_adjustment
from nri_plugin.wire.runtime_support import ClosField, RuntimeSupport
from protos import nri_api_pb2 as api

FIELD_NAMES = ("rdt_class", "memory_limit", "memory_reservation", "oom_score_adj", "unified",
               "annotations", "hooks")
"""The settings fields the policies produce."""

_COLLECTIONS = frozenset({"unified", "annotations", "hooks"})
"""The fields that are a collection: empty sets nothing (a number set to 0 is a value)."""

_RUNTIME_FIELD = {"memory_limit": "memory", "memory_reservation": "memory",
                  "oom_score_adj": "oom_score_adj", "unified": "unified",
                  "annotations": "annotations", "hooks": "hooks"}
"""Settings field -> the adjustment field of :data:`~nri_plugin.wire.runtime_support.APPLIED_FIELDS`
that carries it (the resctrl class goes by :meth:`RuntimeSupport.clos_field`)."""


@dataclass(frozen=True, slots=True)
class Adjustment:
    """What the answer carries, and what happened to the rest."""

    settings: ContainerSettings
    clos_field: ClosField | None
    conflicts: tuple[Conflict, ...] = ()
    # Settings fields left to the reconciler, which applies them after the container starts.
    deferred: tuple[str, ...] = ()
    # Settings fields nothing applies, with the reason.
    dropped: tuple[tuple[str, str], ...] = ()


def route(field: str, support: RuntimeSupport, clos_setting: str,
          reconciler_fields: frozenset[str]) -> str:
    """``adjustment``, ``reconciler`` or ``none`` for one settings field on this runtime."""
    if field == "rdt_class":
        applied = support.clos_field(clos_setting) is not None
    else:
        applied = support.applies(_RUNTIME_FIELD[field])
    if applied:
        return "adjustment"
    return "reconciler" if field in reconciler_fields else "none"


def routes(support: RuntimeSupport, clos_setting: str,
           reconciler_fields: frozenset[str]) -> dict[str, list[str]]:
    """Every settings field by its :func:`route` on this runtime, keyed ``adjustment``,
    ``reconciler`` and ``none`` (each list in :data:`FIELD_NAMES` order, maybe empty)."""
    found: dict[str, list[str]] = {"adjustment": [], "reconciler": [], "none": []}
    for field in FIELD_NAMES:
        found[route(field, support, clos_setting, reconciler_fields)].append(field)
    return found


def decide(parts: Sequence[tuple[str, ContainerSettings]], support: RuntimeSupport,
           clos_setting: str, reconciler_fields: frozenset[str]) -> Adjustment:
    """Merge ``parts`` and keep what the runtime applies (see the module doc)."""
    merged = merge(parts)
    settings = merged.settings
    clos_field = support.clos_field(clos_setting)
    if settings is EMPTY_SETTINGS:
        return Adjustment(settings, clos_field, merged.conflicts)
    deferred: list[str] = []
    dropped: list[tuple[str, str]] = []
    cleared: dict[str, object] = {}
    for name in FIELD_NAMES:
        value = getattr(settings, name)
        if value is None or (name in _COLLECTIONS and not value):
            continue
        way = route(name, support, clos_setting, reconciler_fields)
        if way == "adjustment":
            continue
        cleared[name] = getattr(EMPTY_SETTINGS, name)
        if way == "reconciler":
            deferred.append(name)
        else:
            dropped.append((name, _why(name, clos_setting)))
    if cleared:
        settings = replace(settings, **cleared)  # type: ignore[arg-type]
    return Adjustment(settings, clos_field, merged.conflicts, tuple(deferred), tuple(dropped))


def _why(field: str, clos_setting: str) -> str:
    if field == "rdt_class":
        return f"runtime applies no CLOS field (resctrl.clos_field = {clos_setting})"
    return f"runtime does not apply {field} adjustments"


def set_fields(settings: ContainerSettings) -> list[str]:
    """The fields ``settings`` sets, in :data:`FIELD_NAMES` order: a map by its keys
    (``unified.memory.high``, ``annotations.<key>``), the hooks as one ``hooks``."""
    fields: list[str] = []
    for name in FIELD_NAMES:
        value = getattr(settings, name)
        if name not in _COLLECTIONS:
            if value is not None:
                fields.append(name)
        elif name == "hooks":
            if value:
                fields.append(name)
        else:
            fields += [f"{name}.{key}" for key in value]
    return fields


def encode(adjustment: Adjustment) -> bytes:
    """The CreateContainerResponse; an adjustment that sets nothing is an empty payload."""
    if adjustment.settings.is_empty():
        return b""
    response = api.CreateContainerResponse()
    # Filled in place: building the adjustment apart and copying it in costs a copy per event.
    fill_adjustment(response.adjust, adjustment.settings, clos_field=adjustment.clos_field)
    return response.SerializeToString() if response.adjust.ByteSize() else b""
