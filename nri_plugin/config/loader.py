"""Turn a parsed TOML document into the frozen config dataclasses, or say exactly what is wrong.

The loader is generic: it walks the dataclass tree of :class:`nri_plugin.config.schema.Config` and
checks every value against its type annotation and its :class:`SettingMeta`. Every problem is
reported with the full key path (``memory.levels.reclaimed_cores.high_ratio: must be 0..100, got
140``), and all problems of a file are reported at once.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import re
import stat
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from hooks.config_fields import SettingMeta, frozen_map, meta_of
from hooks.untrusted import bounded

# Digits bounded: no byte size needs more, and a long run of them costs nothing to refuse. ASCII
# only: \d would read other scripts' digits (Arabic-Indic one and Gi as 1 GiB), \s their spaces,
# and IGNORECASE the Kelvin sign as K.
_SIZE_RE = re.compile(r"^\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([KMGT]i?B?|B)?\s*$",
                      re.IGNORECASE | re.ASCII)
_SIZE_FACTORS = {
    "": 1, "B": 1,
    "K": 1000, "KB": 1000, "KI": 1 << 10, "KIB": 1 << 10,
    "M": 1000**2, "MB": 1000**2, "MI": 1 << 20, "MIB": 1 << 20,
    "G": 1000**3, "GB": 1000**3, "GI": 1 << 30, "GIB": 1 << 30,
    "T": 1000**4, "TB": 1000**4, "TI": 1 << 40, "TIB": 1 << 40,
}
_KEY_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
MAX_FILE_BYTES = 1 << 20
"""The largest configuration file read: a Kubernetes ConfigMap holds 1 MiB, and the commented
default is a few dozen KiB."""
MAX_ERROR_CHARS = 512
"""An error line keeps this much of what the file said (a key, a value): the rest is cut, with
its length and hash, so a hostile file cannot flood the terminal or the log."""


class ConfigError(Exception):
    """The configuration is invalid; ``errors`` holds one line per problem, with its key path
    (and, when the configuration comes from several files, the file first: ``source`` is then
    empty)."""

    def __init__(self, errors: list[str], source: str = "") -> None:
        # Bounded, with control characters escaped: keys and values are the file's, and each
        # line reaches a terminal, the log and an audit record.
        self.errors = tuple(bounded(error, MAX_ERROR_CHARS) for error in errors)
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(self.errors))

    def lines(self) -> list[str]:
        """Every error with the file it is about."""
        return [f"{self.source}: {error}" if self.source else error for error in self.errors]


def parse_size(text: str) -> int:
    """Parse ``"4Gi"``, ``"512MiB"``, ``"100M"`` or ``"4096"`` into bytes: ASCII digits, and a
    whole number of bytes (``"1.5Ki"`` is 1536, ``"0.5"`` is refused).

    Not ``kubernetes.utils.parse_quantity``, which reads Kubernetes quantities, not byte sizes:
    it refuses ``"512MiB"`` and ``"7 B"``, takes ``"100m"`` as 0.1 (milli) and ``"0.5"`` as a
    fraction of a byte, accepts ``"-1Gi"`` and ``"1e3"``, and returns a ``Decimal`` that would
    still need checking for a whole non-negative number; and the agent does not install the
    ``kubernetes`` package (``reconciler/kube/transport.py`` says why).
    """
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 4Gi, 512Mi, 100M or a number)")
    suffix = (m.group(2) or "").upper()
    # Exact arithmetic: a float would overflow to infinity on a long run of digits.
    size = Fraction(m.group(1)) * _SIZE_FACTORS[suffix]
    if size.denominator != 1:
        # Cut to whole bytes, 0.0001Ki would silently be 0.
        raise ValueError(f"not a whole number of bytes: {text!r} is {float(size)} bytes")
    return int(size)


def _type_name(tp: Any) -> str:
    if tp is bool:
        return "a boolean"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if dataclasses.is_dataclass(tp):
        return "a table"
    origin = typing.get_origin(tp)
    if origin is tuple:
        return "an array"
    if origin in (Mapping, dict):
        return "a table"
    return str(tp)


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "table"
    return type(value).__name__


class _Builder:
    def __init__(self) -> None:
        self.errors: list[str] = []
        # The key path of each error, for naming the file that set it.
        self.paths: list[str] = []

    def error(self, path: str, text: str) -> None:
        self.errors.append(f"{path}: {text}" if path else text)
        self.paths.append(path)

    def build(self, cls: type[Any], data: Mapping[str, Any], path: str, base: Any = None) -> Any:
        """Build ``cls`` from ``data``; unset keys keep ``base``'s values (or the defaults)."""
        if base is None:
            base = cls()
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in data:
            if key not in fields:
                known = ", ".join(sorted(fields))
                self.error(_join(path, key), f"unknown key (known keys: {known})")
        changes: dict[str, Any] = {}
        for name, f in fields.items():
            if name not in data:
                continue
            value = self.value(hints[name], data[name], _join(path, name), meta_of(f),
                               getattr(base, name))
            if value is not _INVALID:
                changes[name] = value
        built = dataclasses.replace(base, **changes)
        validate = getattr(built, "validate", None)
        if callable(validate):
            for key, text in validate():
                self.error(_join(path, key), text)
        return built

    def value(self, tp: Any, raw: Any, path: str, meta: SettingMeta, base: Any) -> Any:
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                raise TypeError(f"unsupported config annotation {tp!r} at {path}")
            return self.value(args[0], raw, path, meta, base)
        if dataclasses.is_dataclass(tp):
            if not isinstance(raw, dict):
                self.error(path, f"must be a table, got {_toml_type(raw)}")
                return _INVALID
            return self.build(typing.cast(type[Any], tp), raw, path, base)
        if origin is tuple:
            return self.sequence(tp, raw, path, meta)
        if origin in (Mapping, dict):
            return self.mapping(tp, raw, path, meta, base)
        return self.scalar(tp, raw, path, meta)

    def sequence(self, tp: Any, raw: Any, path: str, meta: SettingMeta) -> Any:
        if not isinstance(raw, list):
            self.error(path, f"must be an array, got {_toml_type(raw)}")
            return _INVALID
        args = typing.get_args(tp)
        item_tp = args[0]
        if (len(args) == 2 and args[1] is not Ellipsis) or len(args) > 2:
            if len(raw) != len(args):
                self.error(path, f"must be an array of {len(args)} items, got {len(raw)}")
                return _INVALID
            items = [self.value(a, r, f"{path}[{i}]", _item_meta(meta), None)
                     for i, (a, r) in enumerate(zip(args, raw, strict=True))]
        else:
            items = []
            for i, r in enumerate(raw):
                item_base = None
                if dataclasses.is_dataclass(item_tp):
                    item_base = typing.cast(Any, item_tp)()
                items.append(self.value(item_tp, r, f"{path}[{i}]", _item_meta(meta), item_base))
        if any(v is _INVALID for v in items):
            return _INVALID
        result = tuple(items)
        return self.checked(result, path, meta)

    def mapping(self, tp: Any, raw: Any, path: str, meta: SettingMeta, base: Any) -> Any:
        if not isinstance(raw, dict):
            self.error(path, f"must be a table, got {_toml_type(raw)}")
            return _INVALID
        _key_tp, item_tp = typing.get_args(tp)
        merged: dict[str, Any] = dict(base) if isinstance(base, Mapping) else {}
        ok = True
        for key, item in raw.items():
            item_path = _join(path, key)
            if meta.keys is not None and key not in meta.keys:
                self.error(item_path, f"unknown key (allowed: {', '.join(meta.keys)})")
                ok = False
                continue
            if meta.keys is None and not _KEY_RE.match(key):
                self.error(item_path, "invalid key: use letters, digits and _ . + -")
                ok = False
                continue
            item_base = merged.get(key)
            if item_base is None and dataclasses.is_dataclass(item_tp):
                item_base = typing.cast(type[Any], item_tp)()
            value = self.value(item_tp, item, item_path, _item_meta(meta), item_base)
            if value is _INVALID:
                ok = False
            else:
                merged[key] = value
        if not ok:
            return _INVALID
        return self.checked(frozen_map(merged), path, meta)

    def scalar(self, tp: Any, raw: Any, path: str, meta: SettingMeta) -> Any:
        value: Any
        if tp is bool:
            if not isinstance(raw, bool):
                self.error(path, f"must be a boolean, got {_toml_type(raw)}")
                return _INVALID
            value = raw
        elif tp is int:
            if isinstance(raw, str) and meta.unit == "bytes":
                try:
                    value = parse_size(raw)
                except ValueError as exc:
                    self.error(path, str(exc))
                    return _INVALID
            elif isinstance(raw, int) and not isinstance(raw, bool):
                value = raw
            else:
                self.error(path, f"must be {_type_name(tp)}, got {_toml_type(raw)}")
                return _INVALID
        elif tp is float:
            if isinstance(raw, int | float) and not isinstance(raw, bool):
                try:
                    value = float(raw)
                except OverflowError:
                    # tomllib's integers are unbounded; past a float's, past every range too.
                    self.error(path, f"must be {_range_text(meta.minimum, meta.maximum)}, "
                                     f"got {_num(raw)}")
                    return _INVALID
            else:
                self.error(path, f"must be a number, got {_toml_type(raw)}")
                return _INVALID
            # TOML has nan and inf; no setting means either, and nan slips past range checks.
            if not math.isfinite(value):
                self.error(path, f"must be a finite number, got {raw}")
                return _INVALID
        elif tp is str:
            if not isinstance(raw, str):
                self.error(path, f"must be a string, got {_toml_type(raw)}")
                return _INVALID
            value = raw
        else:
            raise TypeError(f"unsupported config annotation {tp!r} at {path}")
        return self.checked(value, path, meta)

    def checked(self, value: Any, path: str, meta: SettingMeta) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):
            low, high = meta.minimum, meta.maximum
            if (low is not None and value < low) or (high is not None and value > high):
                self.error(path, f"must be {_range_text(low, high)}, got {_num(value)}")
                return _INVALID
        if meta.choices is not None:
            values = value if isinstance(value, tuple) else (value,)
            for v in values:
                if v not in meta.choices:
                    self.error(path, f"must be one of {', '.join(meta.choices)}, got {v!r}")
                    return _INVALID
        if meta.check is not None:
            problem = meta.check(value)
            if problem:
                self.error(path, problem)
                return _INVALID
        return value


def _item_meta(meta: SettingMeta) -> SettingMeta:
    """What applies to each item of an array or table: unit, range and choices, not the check
    (or allowed keys) of the collection as a whole."""
    return dataclasses.replace(meta, check=None, keys=None)


def _num(value: float) -> str:
    if isinstance(value, int):
        # TOML integers are 64-bit, tomllib's are not: one of 20,000 digits has no use in a
        # message (and Python refuses to print it).
        return str(value) if -(1 << 63) <= value < 1 << 63 else "an integer beyond 64 bits"
    return str(int(value)) if value.is_integer() else str(value)


def _range_text(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"{_num(low)}..{_num(high)}"
    if low is not None:
        return f">= {_num(low)}"
    return f"<= {_num(high)}" if high is not None else "valid"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_INVALID: Any = object()


def build_config(cls: type[Any], data: Mapping[str, Any], source: str = "") -> Any:
    """Build ``cls`` (the root config dataclass) from a parsed TOML mapping."""
    builder = _Builder()
    result = builder.build(cls, data, "")
    if builder.errors:
        raise ConfigError(builder.errors, source)
    return result


def parse_toml(cls: type[Any], text: str, source: str = "") -> Any:
    try:
        data = tomllib.loads(text)
    except ValueError as exc:
        # TOMLDecodeError, and the ValueError of an integer literal of thousands of digits.
        raise ConfigError([f"invalid TOML: {exc}"], source) from exc
    except RecursionError as exc:
        # tomllib parses nested arrays and inline tables recursively.
        raise ConfigError(["invalid TOML: arrays or inline tables nested too deep"],
                          source) from exc
    return build_config(cls, data, source)


def load_file(cls: type[Any], path: Path) -> Any:
    """Parse the file at ``path``: a regular file of at most :data:`MAX_FILE_BYTES`, in UTF-8.

    Opened without blocking, so a FIFO or a device named by mistake is refused rather than
    waited on (at start, at every reload) or read without end."""
    return parse_toml(cls, _read_text(path), str(path))


def _read_text(path: Path) -> str:
    try:
        data = _read_regular(path)
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror or exc}"], str(path)) from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"not UTF-8 text: {exc}"], str(path)) from exc


def _parse_document(path: Path) -> dict[str, Any]:
    text = _read_text(path)
    try:
        return tomllib.loads(text)
    except ValueError as exc:
        raise ConfigError([f"invalid TOML: {exc}"], str(path)) from exc
    except RecursionError as exc:
        raise ConfigError(["invalid TOML: arrays or inline tables nested too deep"],
                          str(path)) from exc


KeyPath = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Layered:
    """A configuration read from a main file and its drop-ins."""

    config: Any
    # The files read, in the order they apply.
    files: tuple[str, ...]
    # Each value a file set (tables are walked into, arrays are values) -> the file whose value
    # is in force, the last one that set it; ``data`` is what that file said.
    origins: Mapping[KeyPath, str]
    data: Mapping[str, Any]


def drop_in_dir(main: Path) -> Path:
    """Where the drop-ins of ``main`` are: ``config.toml`` -> ``config.toml.d``."""
    # Not with_name(): it raises for a path without a name ("/", or "" from an unset variable).
    return main.parent / (main.name + ".d")


def drop_ins(main: Path) -> list[Path]:
    """The drop-in files of ``main``, in the order they apply: ``*.toml`` in lexical order
    (hidden names, such as a ConfigMap volume's ``..data``, left out). A path without a file
    name ("/", "") has none: reading it says what is wrong."""
    if not main.name:
        return []
    directory = drop_in_dir(main)
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror or exc}"], str(directory)) from exc
    return [directory / name for name in sorted(names)
            if name.endswith(".toml") and not name.startswith(".")]


def load_layers(cls: type[Any], files: list[Path]) -> Layered:
    """Build ``cls`` from ``files`` applied in order over the defaults: tables merge key by
    key, a later file's value (an array included) replaces an earlier one. Every error names
    the file it is about; all errors of all files are reported at once."""
    merged: dict[str, Any] = {}
    origins: dict[KeyPath, str] = {}
    errors: list[str] = []
    for path in files:
        try:
            document = _parse_document(path)
        except ConfigError as exc:
            errors.extend(exc.lines())
            continue
        _merge(merged, document, str(path), origins)
    if errors:
        raise ConfigError(errors)
    builder = _Builder()
    result = builder.build(cls, merged, "")
    if builder.errors:
        fallback = str(files[-1]) if files else ""
        raise ConfigError([f"{_origin_of(path, origins, fallback)}: {error}"
                           for path, error in zip(builder.paths, builder.errors, strict=True)])
    return Layered(result, tuple(str(f) for f in files), origins, merged)


def _merge(into: dict[str, Any], document: Mapping[str, Any], source: str,
           origins: dict[KeyPath, str]) -> None:
    # Its own stack, in a recursive walk's order: dotted keys (``a.a.a... = 1``) nest tables
    # thousands deep in a few kB, which tomllib parses without recursing; a RecursionError here.
    path: list[str] = []
    stack = [(into, iter(document.items()))]
    while stack:
        target, items = stack[-1]
        for key, value in items:
            if isinstance(value, dict):
                table = target.get(key)
                if not isinstance(table, dict):
                    table = target[key] = {}
                path.append(key)
                stack.append((table, iter(value.items())))
                break
            target[key] = value
            origins[(*path, key)] = source
        else:
            stack.pop()
            if path:
                path.pop()


def _origin_of(path: str, origins: Mapping[KeyPath, str], fallback: str) -> str:
    """The file that set the value an error is about, or one that set something in the same
    table (a rule between two keys of a table names the other key), else ``fallback``."""
    parts = tuple(path.split("[", 1)[0].split(".")) if path else ()
    while parts:
        if parts in origins:
            return origins[parts]
        inside = [source for key, source in origins.items() if key[:len(parts)] == parts]
        if inside:
            return inside[-1]
        parts = parts[:-1]
    return fallback


def _read_regular(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, f"not a regular file ({_file_kind(st.st_mode)})")
        chunks, size = [], 0
        while size <= MAX_FILE_BYTES and (chunk := os.read(fd, MAX_FILE_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_FILE_BYTES:
            raise OSError(0, f"larger than {MAX_FILE_BYTES} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "an unknown kind")
