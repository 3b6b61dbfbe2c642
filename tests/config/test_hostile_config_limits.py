"""Every numeric setting of the configuration has a range, and is refused one step past either
end of it."""

from __future__ import annotations

import dataclasses
import typing
from collections import abc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from hooks.config_fields import meta_of
from nri_plugin.config.loader import ConfigError, parse_toml
from nri_plugin.config.schema import Config


@dataclass(frozen=True)
class Limit:
    key: str
    integer: bool
    minimum: float | None
    maximum: float | None


def numeric_settings(cls: type[Any] = Config, prefix: str = "") -> Iterator[Limit]:
    """Every int or float setting of the schema with its TOML key path (one level of each
    mapping of tables stands for all)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, meta, key = hints[f.name], meta_of(f), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from numeric_settings(typing.cast(type[Any], tp), key + ".")
            continue
        args = typing.get_args(tp)
        if typing.get_origin(tp) is abc.Mapping and dataclasses.is_dataclass(args[1]):
            names = meta.keys or tuple(getattr(cls(), f.name)) or ("0",)
            yield from numeric_settings(typing.cast(type[Any], args[1]), f"{key}.{names[0]}.")
            continue
        if tp in (int, float):
            yield Limit(key, tp is int, meta.minimum, meta.maximum)


LIMITS = list(numeric_settings())


def toml_for(key: str, value: float, integer: bool) -> str:
    table, _, name = key.rpartition(".")
    literal = str(int(value)) if integer else repr(float(value))
    return f"[{table}]\n{name} = {literal}\n" if table else f"{name} = {literal}\n"


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def range_errors(limit: Limit, text: str) -> list[str]:
    """The errors about the setting's range (another setting's check may name the key too)."""
    assert limit.minimum is not None
    assert limit.maximum is not None
    start = f"{limit.key}: must be {number(limit.minimum)}..{number(limit.maximum)}, got "
    try:
        parse_toml(Config, text)
    except ConfigError as exc:
        return [e for e in exc.errors if e.startswith(start)]
    return []


def test_every_numeric_setting_has_a_range() -> None:
    # An unbounded number would let a typo of a few digits through to the kernel or a timer.
    assert [limit.key for limit in LIMITS if limit.minimum is None or limit.maximum is None] == []
    assert {"plugin.deadline_ms", "memory.levels.dedicated_cores.high_ratio",
            "detection.rss_overuse_factor"} <= {limit.key for limit in LIMITS}


@pytest.mark.parametrize("limit", LIMITS, ids=lambda limit: limit.key)
def test_every_numeric_setting_at_its_exact_limits(limit: Limit) -> None:
    assert limit.minimum is not None
    assert limit.maximum is not None
    step = 1 if limit.integer else max(abs(limit.maximum - limit.minimum) * 1e-6, 1e-9)
    for inside in (limit.minimum, limit.maximum):
        assert range_errors(limit, toml_for(limit.key, inside, limit.integer)) == []
    for outside in (limit.minimum - step, limit.maximum + step):
        assert len(range_errors(limit, toml_for(limit.key, outside, limit.integer))) == 1
