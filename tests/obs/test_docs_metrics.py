"""The series docs/operations.md lists are the series the agent exports: each name, type and
label set of its table is the registry's, every exported ``nri_qos_`` series is in the table, and
every ``nri_qos_`` name any doc, the README or deploy/ mentions is one the agent exports."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from reconciler import runner
from tests.support.paths import REPO
from tests.support.populated_metrics import populated_registry

OPERATIONS = REPO / "docs" / "operations.md"
PREFIX = "nri_qos_"


@dataclass(frozen=True)
class Series:
    """One exported series family: its OpenMetrics type and the label names of its samples."""

    kind: str
    labels: frozenset[str]


def exported() -> dict[str, Series]:
    """Series name as a query names it (counters with ``_total``, info with ``_info``) ->
    what it is."""
    text = generate_latest(populated_registry()).decode()
    found: dict[str, Series] = {}
    for family in text_string_to_metric_families(text):
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        labels = frozenset(label for sample in family.samples for label in sample.labels
                           if label not in ("le", "quantile"))
        found[family.name + suffix] = Series(family.type, labels)
    return found


@dataclass(frozen=True)
class Row:
    names: tuple[str, ...]
    kind: str
    labels: frozenset[str]


def documented() -> list[Row]:
    """The rows of the series table of docs/operations.md naming ``nri_qos_`` series."""
    rows = []
    for line in OPERATIONS.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith(f"`{PREFIX}"):
            continue
        names = tuple(re.findall(r"`([a-z0-9_]+)`", cells[0]))
        # A parenthesis says which of the row's series carries a label, or lists its values.
        labels = frozenset(re.findall(r"`([a-z0-9_]+)`", re.sub(r"\([^)]*\)", "", cells[2])))
        rows.append(Row(names, cells[1], labels))
    return rows


def test_the_table_is_found() -> None:
    names = {name for row in documented() for name in row.names}
    assert {"nri_qos_build_info", "nri_qos_nri_requests_total",
            "nri_qos_offload_refaults_per_second"} <= names


@pytest.mark.parametrize("row", documented(), ids=lambda row: row.names[0])
def test_each_documented_series_is_exported_with_its_type_and_labels(row: Row) -> None:
    series = exported()
    missing = [name for name in row.names if name not in series]
    assert missing == [], f"documented, not exported: {missing}"
    for name in row.names:
        assert series[name].kind == row.kind, name
    assert frozenset().union(*(series[name].labels for name in row.names)) == row.labels


def test_every_exported_series_is_documented() -> None:
    listed = {name for row in documented() for name in row.names}
    ours = {name for name in exported() if name.startswith(PREFIX)}
    assert sorted(ours - listed) == []


def mentioned() -> dict[str, set[str]]:
    """Every ``nri_qos_`` series name in the docs, the README and deploy/ -> where."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted(p for p in (REPO / "deploy").rglob("*") if p.is_file())]
    found: dict[str, set[str]] = {}
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for name in re.findall(rf"\b{PREFIX}[a-z0-9_]*[a-z0-9]", text):
            found.setdefault(name, set()).add(str(Path(path).relative_to(REPO)))
    return found


def test_every_series_a_doc_or_manifest_names_is_exported() -> None:
    names = set(exported())
    # A query may select a histogram's own series.
    names |= {f"{name}{part}" for name, s in exported().items() if s.kind == "histogram"
              for part in ("_bucket", "_count", "_sum")}
    unknown = {name: sorted(where) for name, where in mentioned().items() if name not in names}
    assert unknown == {}


def built_loops() -> set[str]:
    """The names of the loops :func:`reconciler.runner.build_loops` makes (each one's cycles
    are what ``nri_qos_reconciler_cycle_*`` count, by ``loop``)."""
    source = inspect.getsource(runner.build_loops)
    classes = {node.func.id for node in ast.walk(ast.parse(textwrap.dedent(source)))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
               and node.func.id.endswith("Loop")}
    return {getattr(runner, name).name for name in classes}


def test_the_cycle_series_name_every_loop_the_reconciler_runs() -> None:
    (row,) = [line for line in OPERATIONS.read_text(encoding="utf-8").splitlines()
              if line.startswith(f"| `{PREFIX}reconciler_cycle_duration_seconds`")]
    meaning = row.strip().strip("|").split("|")[3]
    assert {"drift", "offload"} <= built_loops()
    assert set(re.findall(r"`([a-z_]+)`", meaning)) == built_loops()
