"""What the docs say of the configuration is what the schema and the agent hold: the keys
docs/configuration.md says are read at start are :data:`START_ONLY`, and so is every key the host
probe reads at start; every default a doc's ``| key | default |`` table gives is the default of
that key."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from common.audit import AuditLog, MemoryAuditSink
from hooks.config_fields import meta_of
from nri_plugin.agent import probe
from nri_plugin.config.schema import Config
from nri_plugin.config.start_only import START_ONLY, value_at
from tests.support.fakesys import GIB, FakeHost
from tests.support.paths import REPO

CONFIGURATION = REPO / "docs" / "configuration.md"


def table(text: str, header: str) -> Iterator[list[str]]:
    """The rows (as cells) of the Markdown table headed by ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            return
        yield [cell.strip() for cell in line.strip().strip("|").split("|")]


def documented_start_only() -> dict[str, bool]:
    """Dotted key -> whether the table says it is read at start only when it is off then."""
    found: dict[str, bool] = {}
    text = CONFIGURATION.read_text(encoding="utf-8")
    for cells in table(text, "| keys | read at start by |"):
        keys, _, condition = cells[0].partition(" when ")
        section = ""
        for span in re.findall(r"`([^`]+)`", keys):
            named = re.fullmatch(r"\[([a-z_.]+)\](?: ([a-z_]+))?", span)
            if named:
                section, key = named.group(1), named.group(2)
            else:
                key = span
            if key is None and "every key" in keys:
                fields = dataclasses.fields(value_at(Config(), section))
                found.update({f"{section}.{f.name}": False for f in fields})
            elif key is not None:
                found[f"{section}.{key}"] = "`false` at start" in condition
    return found


def test_the_start_only_table_is_start_only() -> None:
    assert documented_start_only() == {entry.key: entry.switch for entry in START_ONLY}


# --- the defaults the docs give -----------------------------------------------------------------

# A doc's table, and the section its short key names are in.
DEFAULT_TABLES = {
    "detection.md": "",
    "eviction.md": "eviction",
    "memory-qos.md": "",
    "oom-score.md": "",
    "resctrl.md": "",
    "offloading.md": "offload",
}
UNITS = {"ms": 1, "s": 1, "%": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30,
         "MiB/s": 1 << 20}


def value(text: str) -> Any:
    """A default as a doc writes it, as the schema holds it (None: not a plain value)."""
    text = text.strip().strip("`").strip()
    text = re.sub(r" \((?:off|v2)\)$", "", text)
    if text in ("true", "false"):
        return text == "true"
    if text == "[]":
        return ()
    if text.startswith("["):
        return tuple(item.strip().strip('"') for item in text.strip("[]").split(","))
    number = re.fullmatch(r"(-?[0-9.]+)(?: ?([A-Za-z%/]+))?", text)
    if number:
        unit = number.group(2)
        if unit is not None and unit not in UNITS:
            return None
        amount = float(number.group(1)) * UNITS.get(unit or "", 1)
        return int(amount) if amount.is_integer() else amount
    if re.fullmatch(r"[a-z_]+(, [a-z_]+)+", text):
        return tuple(text.split(", "))
    if re.fullmatch(r"[A-Za-z0-9_./-]+", text):
        return text
    return None


def same(documented: Any, actual: Any) -> bool:
    if isinstance(actual, bool) or isinstance(documented, bool):
        return documented is actual
    if isinstance(actual, int | float) and isinstance(documented, int | float):
        return float(documented) == float(actual)
    return bool(documented == actual)


def documented_defaults() -> Iterator[tuple[str, str, Any]]:
    """(doc, dotted key, default) of each row naming one key, or several keys with one default
    or as many defaults, whose default is a plain value."""
    for name, section in DEFAULT_TABLES.items():
        text = (REPO / "docs" / name).read_text(encoding="utf-8")
        for cells in table(text, "| key | default |"):
            keys = re.findall(r"`([a-z0-9_.]+)`", cells[0])
            if not keys or "<" in cells[0] or "*" in cells[0] or "{" in cells[0]:
                continue
            first = keys[0] if "." in keys[0] or not section else f"{section}.{keys[0]}"
            defaults = cells[1].split(", ") if len(keys) > 1 else [cells[1]]
            if len(defaults) == 1:
                # One default said once for every key of the row.
                defaults *= len(keys)
            if len(defaults) != len(keys):
                continue
            for i, key in enumerate(keys):
                dotted = first if i == 0 else sibling(first, key)
                parsed = value(defaults[i])
                if parsed is not None:
                    yield name, dotted, parsed


def sibling(first: str, key: str) -> str:
    """The full name of a key a row shortens after its first one: ``medium`` after
    ``detection.kswapd_low_pages_per_s`` is ``detection.kswapd_medium_pages_per_s``."""
    section, _, leaf = first.rpartition(".")
    for level in ("low", "medium", "high"):
        if f"_{level}_" in leaf and re.fullmatch(r"low|medium|high", key):
            return f"{section}.{leaf.replace(f'_{level}_', f'_{key}_')}"
    return f"{section}.{key}"


def test_the_default_tables_are_found() -> None:
    keys = {key for _, key, _ in documented_defaults()}
    assert {"detection.kswapd_high_pages_per_s", "eviction.priority_threshold",
            "memory.page_size", "oom.offline_min_score", "resctrl.amd_mb_max",
            "offload.max_bytes_per_s"} <= keys


@pytest.mark.parametrize(("doc", "key", "default"), list(documented_defaults()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_documented_default_is_the_default(doc: str, key: str, default: Any) -> None:
    actual = value_at(Config(), key)
    assert same(default, actual), f"{doc}: {key} documented {default!r}, is {actual!r}"


# --- what the host probe reads is read at start ------------------------------------------------

class Recorder:
    """A configuration section that notes every key read through it."""

    def __init__(self, wrapped: Any, prefix: str, seen: set[str]) -> None:
        self._wrapped, self._prefix, self._seen = wrapped, prefix, seen

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._wrapped, name)
        key = f"{self._prefix}{name}"
        if dataclasses.is_dataclass(value):
            return Recorder(value, f"{key}.", self._seen)
        self._seen.add(key)
        return value


def test_every_key_the_host_probe_reads_is_start_only(tmp_path: Path) -> None:
    """The probe runs once, at start, and what it makes of a key (the cgroup layout, the NUMA
    view, resctrl) stays for the agent's life: such a key is read at start only, held from the
    start's configuration for every part of the agent alike and said at a reload that changes
    it."""
    host = FakeHost(tmp_path / "host", version=2, driver="systemd")
    host.set_numa([(20 * GIB, 32 * GIB, 100), (20 * GIB, 32 * GIB, 100)])
    host.make_resctrl()
    cfg = dataclasses.replace(Config(), reconciler=dataclasses.replace(
        Config().reconciler, root=str(host.root)))
    seen: set[str] = set()
    probe(cast(Config, Recorder(cfg, "", seen)), AuditLog(MemoryAuditSink()))
    assert {"reconciler.root", "memory.cgroup_version", "resctrl.root"} <= seen
    assert sorted(seen - {entry.key for entry in START_ONLY}) == []


def documented_ranges() -> Iterator[tuple[str, float, float]]:
    """(dotted key, minimum, maximum) of each row of docs/eviction.md's table that gives a
    range ``a..b`` (``-1 or 1..b``: -1 is the minimum, 0 refused by a check of its own)."""
    text = (REPO / "docs" / "eviction.md").read_text(encoding="utf-8")
    for cells in table(text, "| key | default | unit, range |"):
        found = re.search(r"(-1 or )?(-?[0-9.]+)\.\.(-?[0-9.]+)", cells[2])
        if found is None:
            continue
        low = -1.0 if found.group(1) else float(found.group(2))
        for key in re.findall(r"`([a-z0-9_]+)`", cells[0]):
            yield f"eviction.{key}", low, float(found.group(3))


def test_each_documented_range_is_the_settings_range() -> None:
    ranges = list(documented_ranges())
    assert ("eviction.priority_threshold", -2147483648.0, 2147483647.0) in ranges
    section = Config().eviction
    for key, low, high in ranges:
        (field,) = [f for f in dataclasses.fields(section) if f"eviction.{f.name}" == key]
        meta = meta_of(field)
        assert (meta.minimum, meta.maximum) == (low, high), key
