"""Write a configuration back as TOML: the commented default file, or the effective config.

The renderer walks the same dataclass tree as the loader and reads the same field metadata, so
the default file documents every key with its unit, range and default, and whatever it prints
parses back to the configuration it was given.

Layout: every dataclass is a ``[table]``; a mapping of dataclasses is one table per key
(``[memory.levels.reclaimed_cores]``); a tuple of dataclasses is an array of tables
(``[[oci_hooks.levels.reclaimed_cores.prestart]]``); a mapping of plain values is a table of
keys. An empty collection of tables is shown as a commented example in the commented file and
left out of the effective config, where leaving it out means the same thing.
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any

from hooks.config_fields import SettingMeta, meta_of
from nri_plugin.config.loader import _num
from nri_plugin.config.schema import Config

HEADER = """\
nri-qos node configuration (default /etc/nri-qos/config.toml).

Every key is optional: a key left out keeps the default shown here. Each setting is preceded
by its description, then (unit, valid range or choices, default). Byte sizes may be written as
integers or as strings such as "512Mi" or "4Gi". Check a file with `nri-qos check-config PATH`;
this file is printed by `nri-qos default-config`."""

_WIDTH = 99
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_SIZE_UNITS = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
            "\r": "\\r"}


def render_toml(cfg: Config, *, commented: bool) -> str:
    """``cfg`` as a TOML document; ``commented`` adds the documentation and examples."""
    renderer = _Renderer(commented)
    if commented:
        renderer.lines += _comment_lines(HEADER)
    renderer.body(cfg, type(cfg)(), ())
    return "\n".join(renderer.lines).strip("\n") + "\n"


# --- values -------------------------------------------------------------------------------------

def _string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else _string(name)


def _size(value: int) -> str | None:
    """``"16Mi"`` for an exact multiple of a binary unit, else None."""
    for suffix, factor in _SIZE_UNITS:
        if value >= factor and value % factor == 0:
            return f"{value // factor}{suffix}"
    return None


def _literal(value: Any, meta: SettingMeta | None = None) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        size = _size(value) if meta is not None and meta.unit == "bytes" else None
        return _string(size) if size else str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_literal(v, meta) for v in value) + "]"
    if isinstance(value, Mapping):
        items = ", ".join(f"{_key(k)} = {_literal(v, meta)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if value is None:
        raise TypeError("TOML has no null: config values must not be None")
    raise TypeError(f"cannot render config value {value!r}")


def toml_value(value: Any) -> str:
    """A value of a parsed TOML document (arrays as lists, tables as dicts) written back."""
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_key(k)} = {toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    return _literal(value)


# --- types --------------------------------------------------------------------------------------

def _unwrap(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _item_type(tp: Any) -> Any:
    """The element type of a tuple or the value type of a mapping, else None."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        return _unwrap(typing.get_args(tp)[0])
    if origin in (Mapping, dict):
        return _unwrap(typing.get_args(tp)[1])
    return None


def _is_mapping(tp: Any) -> bool:
    return typing.get_origin(tp) in (Mapping, dict)


def _holds_tables(tp: Any) -> bool:
    item = _item_type(tp)
    return item is not None and dataclasses.is_dataclass(item)


def _example_key(meta: SettingMeta) -> str:
    return meta.keys[0] if meta.keys else "0"


def _example(cls: type[Any]) -> Any:
    """``cls()`` with one item in each empty collection of tables, for commented examples."""
    obj = cls()
    hints = typing.get_type_hints(cls)
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        tp = _unwrap(hints[f.name])
        value = getattr(obj, f.name)
        if _holds_tables(tp) and not value:
            item = _example(_item_type(tp))
            changes[f.name] = ({_example_key(meta_of(f)): item} if _is_mapping(tp) else (item,))
    return dataclasses.replace(obj, **changes)


# --- comments -----------------------------------------------------------------------------------

def _comment_lines(text: str) -> list[str]:
    lines: list[str] = []
    for paragraph in text.split("\n"):
        if not paragraph.strip():
            lines.append("#")
            continue
        lines += textwrap.wrap(paragraph, _WIDTH, initial_indent="# ", subsequent_indent="# ",
                               break_on_hyphens=False, break_long_words=False)
    return lines


def _bound(value: float, meta: SettingMeta) -> str:
    if meta.unit == "bytes" and float(value).is_integer():
        size = _size(int(value))
        if size:
            return size
    return _num(value)


def _describe(meta: SettingMeta, default: Any, *, leaf: bool) -> str:
    facts: list[str] = []
    if meta.unit:
        facts.append(meta.unit)
    low, high = meta.minimum, meta.maximum
    if low is not None and high is not None:
        facts.append(f"{_bound(low, meta)}..{_bound(high, meta)}")
    elif low is not None:
        facts.append(f">= {_bound(low, meta)}")
    elif high is not None:
        facts.append(f"<= {_bound(high, meta)}")
    if meta.choices:
        facts.append("one of " + ", ".join(meta.choices))
    if meta.keys:
        facts.append("keys " + ", ".join(meta.keys))
    if leaf:
        facts.append("default " + _literal(default, meta))
    return f"{meta.doc} ({'; '.join(facts)})" if facts else meta.doc


# --- tables -------------------------------------------------------------------------------------

class _Renderer:
    def __init__(self, commented: bool) -> None:
        self.commented = commented
        self.lines: list[str] = []

    def blank(self) -> None:
        if self.lines and self.lines[-1] != "":
            self.lines.append("")

    def doc(self, text: str) -> None:
        if self.commented:
            self.lines += _comment_lines(text)

    def header(self, path: tuple[str, ...], *, array: bool = False) -> None:
        name = ".".join(_key(p) for p in path)
        self.lines.append(f"[[{name}]]" if array else f"[{name}]")

    def body(self, obj: Any, default: Any, path: tuple[str, ...]) -> None:
        """The keys of one table: plain values first (TOML needs them before any sub-table)."""
        hints = typing.get_type_hints(type(obj))
        tables = []
        for f in dataclasses.fields(obj):
            tp = _unwrap(hints[f.name])
            meta = meta_of(f)
            value, dflt = getattr(obj, f.name), getattr(default, f.name)
            if dataclasses.is_dataclass(tp) or (_holds_tables(tp) and (value or not dflt)) \
                    or (_is_mapping(tp) and value):
                tables.append((f.name, tp, meta, value, dflt))
                continue
            self.doc(_describe(meta, dflt, leaf=True))
            self.lines.append(f"{_key(f.name)} = {_literal(value, meta)}")
        for name, tp, meta, value, dflt in tables:
            self.sub_table((*path, name), tp, meta, value, dflt)

    def table(self, path: tuple[str, ...], obj: Any, default: Any, doc: str | None,
              *, array: bool = False, gap: bool = True) -> None:
        if gap:
            self.blank()
        if doc:
            self.doc(doc)
        self.header(path, array=array)
        self.body(obj, default, path)

    def sub_table(self, path: tuple[str, ...], tp: Any, meta: SettingMeta, value: Any,
                  default: Any) -> None:
        if dataclasses.is_dataclass(tp):
            self.table(path, value, default, meta.doc)
            return
        item = _item_type(tp)
        if not dataclasses.is_dataclass(item):
            # A mapping of plain values: one key per entry.
            self.blank()
            self.doc(_describe(meta, default, leaf=False))
            self.header(path)
            for key, entry in value.items():
                self.lines.append(f"{_key(key)} = {_literal(entry, meta)}")
            return
        item_tp = typing.cast(type[Any], item)
        self.blank()
        self.doc(_describe(meta, default, leaf=False))
        if not value:
            if self.commented:
                self.example(path, tp, meta, item_tp)
            return
        # The collection's description sits right above its first table.
        if _is_mapping(tp):
            for i, (key, entry) in enumerate(value.items()):
                entry_default = default.get(key) if isinstance(default, Mapping) else None
                if entry_default is None:
                    entry_default = item_tp()
                self.table((*path, key), entry, entry_default, None, gap=i > 0)
        else:
            for i, entry in enumerate(value):
                self.table(path, entry, item_tp(), None, array=True, gap=i > 0)

    def example(self, path: tuple[str, ...], tp: Any, meta: SettingMeta,
                item_tp: type[Any]) -> None:
        inner = _Renderer(commented=True)
        item = _example(item_tp)
        if _is_mapping(tp):
            inner.table((*path, _example_key(meta)), item, item, None, gap=False)
        else:
            inner.table(path, item, item, None, array=True, gap=False)
        self.lines.append("# None by default. Example:")
        self.lines += [f"# {line}" if line else "#" for line in inner.lines]
