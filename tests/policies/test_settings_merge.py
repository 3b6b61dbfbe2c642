"""The one place where capabilities' answers meet: first owner wins, conflicts are reported."""

from __future__ import annotations

import pytest

from hooks.settings import (
    EMPTY_SETTINGS,
    ContainerSettings,
    HookStage,
    OciHookSpec,
    merge,
)


def test_empty_chain_gives_empty_settings() -> None:
    result = merge([])
    assert result.settings.is_empty()
    assert result.conflicts == ()


def test_disjoint_parts_combine() -> None:
    result = merge([
        ("resctrl", ContainerSettings(rdt_class="nriqos-reclaimed_cores")),
        ("memory", ContainerSettings(unified={"memory.high": "100"})),
        ("oom", ContainerSettings(oom_score_adj=1000)),
    ])
    s = result.settings
    assert (s.rdt_class, dict(s.unified), s.oom_score_adj) == (
        "nriqos-reclaimed_cores", {"memory.high": "100"}, 1000)
    assert result.owners == {
        "rdt_class": "resctrl", "unified.memory.high": "memory", "oom_score_adj": "oom"}
    assert result.conflicts == ()


def test_first_owner_wins_and_conflict_is_reported() -> None:
    result = merge([
        ("a", ContainerSettings(oom_score_adj=500, unified={"memory.low": "1"})),
        ("b", ContainerSettings(oom_score_adj=1000,
                                unified={"memory.low": "2", "memory.min": "3"})),
    ])
    assert result.settings.oom_score_adj == 500
    assert dict(result.settings.unified) == {"memory.low": "1", "memory.min": "3"}
    fields = {(c.field, c.owner, c.kept, c.rejected_by, c.rejected) for c in result.conflicts}
    assert fields == {
        ("oom_score_adj", "a", 500, "b", 1000),
        ("unified.memory.low", "a", "1", "b", "2"),
    }


def test_equal_values_are_not_a_conflict() -> None:
    part = ContainerSettings(memory_limit=1 << 20, annotations={"k": "v"})
    result = merge([("a", part), ("b", part)])
    assert result.conflicts == ()
    assert result.settings.memory_limit == 1 << 20


def test_hooks_are_appended_in_order() -> None:
    h1 = OciHookSpec(HookStage.PRESTART, "/bin/a")
    h2 = OciHookSpec(HookStage.POSTSTOP, "/bin/b", args=("b", "x"), timeout_s=3)
    result = merge([("x", ContainerSettings(hooks=(h1,))), ("y", ContainerSettings(hooks=(h2,)))])
    assert result.settings.hooks == (h1, h2)


@pytest.mark.parametrize("value", [0, None])
def test_zero_is_a_value_none_is_no_opinion(value: int | None) -> None:
    result = merge([("a", ContainerSettings(oom_score_adj=value)), ("b", EMPTY_SETTINGS)])
    assert result.settings.oom_score_adj == value
    assert ("oom_score_adj" in result.owners) is (value is not None)
