"""Audit catalogue (code, catalogue and docs agree), record checks, the rotating audit file."""

from __future__ import annotations

import ast
import json
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from common.audit import CATALOGUE, RESERVED_FIELDS, AuditLog, MemoryAuditSink
from nri_plugin.obs.audit_sinks import AuditFile, LogAuditSink, json_text
from nri_plugin.obs.log_context import bound_fields
from tests.support.paths import REPO

SOURCE_DIRS = ("nri_plugin", "hooks", "reconciler", "common")


def minimal_fields(event: str) -> dict[str, Any]:
    return {name: "x" for name in CATALOGUE[event].required}


# --- the catalogue and the code -----------------------------------------------------------------

def record_calls() -> list[tuple[str, int, str, set[str] | None]]:
    """Every ``*record("name", ...)`` call with a literal name: (file, line, name, keywords or
    None when the call passes ``**fields``)."""
    found = []
    for top in SOURCE_DIRS:
        for path in sorted((REPO / top).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                first = node.args[0]
                if not (name.endswith("record") and isinstance(first, ast.Constant)
                        and isinstance(first.value, str)):
                    continue
                keywords: set[str] | None = {k.arg for k in node.keywords if k.arg is not None}
                if any(k.arg is None for k in node.keywords):
                    keywords = None
                found.append((str(path.relative_to(REPO)), node.lineno, first.value, keywords))
    return found


def test_the_walk_finds_the_code_base_records() -> None:
    names = {name for _, _, name, _ in record_calls()}
    assert {"config_loaded", "config_rejected"} <= names


def test_every_recorded_event_is_in_the_catalogue_with_its_required_fields() -> None:
    problems = []
    for where, line, name, keywords in record_calls():
        spec = CATALOGUE.get(name)
        if spec is None:
            problems.append(f"{where}:{line}: {name!r} is not in the catalogue")
            continue
        if keywords is not None:
            missing = [f for f in spec.required if f not in keywords]
            if missing:
                problems.append(f"{where}:{line}: {name!r} lacks {', '.join(missing)}")
            reserved = sorted(RESERVED_FIELDS & keywords)
            if reserved:
                problems.append(f"{where}:{line}: {name!r} uses reserved {', '.join(reserved)}")
    assert problems == []


def test_catalogue_entries_are_well_formed() -> None:
    for name, spec in CATALOGUE.items():
        assert spec.name == name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name)
        assert spec.description.strip()
        assert not RESERVED_FIELDS & set(spec.required), name
        assert len(set(spec.required)) == len(spec.required), name


def documented_catalogue() -> dict[str, tuple[str, ...]]:
    text = (REPO / "docs" / "audit.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| ((?:`[a-z0-9_]+`(?:, )?)*) \| (.+) \|$", text, re.M)
    return {name: tuple(re.findall(r"`([a-z0-9_]+)`", fields)) for name, fields, _ in rows}


def test_docs_list_exactly_the_catalogue() -> None:
    documented = documented_catalogue()
    assert documented == {name: spec.required for name, spec in CATALOGUE.items()}


# --- record checks ------------------------------------------------------------------------------

@pytest.mark.parametrize("event", sorted(CATALOGUE))
def test_every_catalogue_event_records_with_its_required_fields(event: str) -> None:
    sink = MemoryAuditSink()
    AuditLog(sink).record(event, **minimal_fields(event), extra=1)
    assert sink.records == [(event, {**minimal_fields(event), "extra": 1})]


def test_unknown_event_raises() -> None:
    sink = MemoryAuditSink()
    with pytest.raises(ValueError, match="'made_up' is not in the catalogue"):
        AuditLog(sink).record("made_up", reason="x")
    assert sink.records == []


@pytest.mark.parametrize("event", sorted(e for e in CATALOGUE if CATALOGUE[e].required))
def test_each_missing_required_field_raises(event: str) -> None:
    log = AuditLog(MemoryAuditSink())
    for left_out in CATALOGUE[event].required:
        fields = minimal_fields(event)
        del fields[left_out]
        with pytest.raises(ValueError, match=f"lacks required fields: {left_out}"):
            log.record(event, **fields)


def test_reserved_field_names_raise() -> None:
    log = AuditLog(MemoryAuditSink())
    with pytest.raises(ValueError, match="reserved field names: event, timestamp"):
        log.record("config_loaded", source="x", event="y", timestamp="z")
    # A "level" field would shadow the log level of the JSON line.
    with pytest.raises(ValueError, match="reserved field names: level"):
        log.record("config_loaded", source="x", level="reclaimed_cores")


def test_memory_sink_named() -> None:
    sink = MemoryAuditSink()
    log = AuditLog(sink)
    log.record("taint_added", node="n", taint="t", reason="r")
    log.record("eviction_done", pod="ns/p")
    assert sink.named("eviction_done") == [{"pod": "ns/p"}]


# --- the audit file -----------------------------------------------------------------------------

def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_audit_file_appends_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text('{"old": 1}\n', encoding="utf-8")
    f = AuditFile(str(path), max_bytes=1 << 20, backups=2)
    f.write({"event": "a", "n": 1, "text": "ü\n"})
    f.close()
    assert read_lines(path) == [{"old": 1}, {"event": "a", "n": 1, "text": "ü\n"}]


def test_audit_file_rotates_by_size_and_keeps_backups(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    f = AuditFile(str(path), max_bytes=100, backups=2)
    for i in range(12):
        f.write({"i": i, "pad": "x" * 27})  # 47 or 48 bytes a line: two lines a file
    f.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"
    ]
    assert [r["i"] for r in read_lines(path)] == [10, 11]
    assert [r["i"] for r in read_lines(tmp_path / "audit.jsonl.1")] == [8, 9]
    assert [r["i"] for r in read_lines(tmp_path / "audit.jsonl.2")] == [6, 7]
    assert all(p.stat().st_size <= 100 for p in tmp_path.iterdir())


def test_audit_file_size_counts_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text("x" * 95 + "\n", encoding="utf-8")
    f = AuditFile(str(path), max_bytes=100, backups=1)
    f.write({"i": 1})
    f.close()
    assert read_lines(path) == [{"i": 1}]
    assert (tmp_path / "audit.jsonl.1").read_text(encoding="utf-8") == "x" * 95 + "\n"


def test_audit_file_without_backups_truncates(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    f = AuditFile(str(path), max_bytes=60, backups=0)
    for i in range(5):
        f.write({"i": i, "pad": "y" * 10})  # 28 bytes a line
    f.close()
    assert [p.name for p in tmp_path.iterdir()] == ["audit.jsonl"]
    assert [r["i"] for r in read_lines(path)] == [4]


def test_a_line_longer_than_the_limit_gets_a_file_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    f = AuditFile(str(path), max_bytes=20, backups=3)
    f.write({"i": 0})
    f.write({"i": 1, "pad": "z" * 50})
    f.write({"i": 2})
    f.close()
    assert [r["i"] for r in read_lines(tmp_path / "audit.jsonl.2")] == [0]
    assert [r["i"] for r in read_lines(tmp_path / "audit.jsonl.1")] == [1]
    assert [r["i"] for r in read_lines(path)] == [2]


def test_a_line_that_fills_the_file_to_the_limit_stays_in_it(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text("x" * 91 + "\n", encoding="utf-8")
    f = AuditFile(str(path), max_bytes=100, backups=1)
    f.write({"i": 1})  # 8 bytes: 100 in all, not past the limit
    f.close()
    assert path.stat().st_size == 100
    assert not (tmp_path / "audit.jsonl.1").exists()


def test_a_first_line_longer_than_the_limit_leaves_no_empty_backup(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    (tmp_path / "audit.jsonl.1").write_text('{"i": 0}\n', encoding="utf-8")
    f = AuditFile(str(path), max_bytes=20, backups=1)
    f.write({"i": 1, "pad": "z" * 50})
    f.close()
    assert [r["i"] for r in read_lines(tmp_path / "audit.jsonl.1")] == [0]
    assert [r["i"] for r in read_lines(path)] == [1]


def test_a_file_removed_under_the_agent_is_started_anew_at_rotation(tmp_path: Path) -> None:
    """An operator (or a log shipper) removed the file: lines go on to the removed file until
    it is full, then a new file starts, and the backups stay where they are."""
    path = tmp_path / "audit.jsonl"
    (tmp_path / "audit.jsonl.1").write_text('{"i": 0}\n', encoding="utf-8")
    f = AuditFile(str(path), max_bytes=20, backups=2)  # two 8-byte lines a file
    f.write({"i": 1})
    path.unlink()
    for i in range(2, 7):
        f.write({"i": i})
    f.close()
    assert [r["i"] for r in read_lines(tmp_path / "audit.jsonl.2")] == [0]
    assert [r["i"] for r in read_lines(tmp_path / "audit.jsonl.1")] == [3, 4]
    assert [r["i"] for r in read_lines(path)] == [5, 6]


def test_audit_file_is_thread_safe(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    f = AuditFile(str(path), max_bytes=4096, backups=50)

    def writer(t: int) -> None:
        for i in range(200):
            f.write({"t": t, "i": i})

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    f.close()
    records = [r for p in tmp_path.iterdir() for r in read_lines(p)]
    assert sorted((r["t"], r["i"]) for r in records) == [(t, i) for t in range(4)
                                                          for i in range(200)]


def test_audit_file_rejects_bad_limits(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        AuditFile(str(tmp_path / "a"), max_bytes=0, backups=1)
    with pytest.raises(FileNotFoundError):
        AuditFile(str(tmp_path / "missing-dir" / "a"), max_bytes=100, backups=1)


# --- the production sink ------------------------------------------------------------------------

class ListLogger:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append(("info", event, fields))

    def error(self, event: str, **fields: Any) -> None:
        self.lines.append(("error", event, fields))


def test_sink_writes_stream_and_file_with_one_timestamp(tmp_path: Path) -> None:
    stream, errors = ListLogger(), ListLogger()
    sink = LogAuditSink(stream, errors, wall_clock=lambda: 1_700_000_000.25)
    sink.set_file(AuditFile(str(tmp_path / "a.jsonl"), 1 << 20, 1))
    with bound_fields({"nri_event": "create_container", "pod_uid": "ctx"}):
        AuditLog(sink).record("adjustment_skipped", pod_uid="u1", container="c", reason="r")
    sink.set_file(None)
    stamp = "2023-11-14T22:13:20.250000Z"
    assert stream.lines == [("info", "adjustment_skipped", {
        "timestamp": stamp, "level": "info", "logger": "nri_qos.audit", "audit": True,
        "pod_uid": "u1", "container": "c", "reason": "r"})]
    assert read_lines(tmp_path / "a.jsonl") == [{
        "timestamp": stamp, "level": "info", "logger": "nri_qos.audit", "audit": True,
        "event": "adjustment_skipped", "nri_event": "create_container", "pod_uid": "u1",
        "container": "c", "reason": "r"}]
    assert errors.lines == []


def test_sink_survives_a_failing_file_and_says_so_once(tmp_path: Path) -> None:
    stream, errors = ListLogger(), ListLogger()
    sink = LogAuditSink(stream, errors)
    broken = AuditFile(str(tmp_path / "a.jsonl"), 1 << 20, 1)
    sink.set_file(broken)
    broken.close()  # every write now fails
    log = AuditLog(sink)
    for _ in range(3):
        log.record("eviction_done", pod="ns/p")
    assert len(stream.lines) == 3
    assert [(lvl, ev) for lvl, ev, _ in errors.lines] == [("error", "audit_file_write_failed")]
    assert errors.lines[0][2]["path"] == str(tmp_path / "a.jsonl")


def test_sink_swaps_files_and_closes_the_old_one(tmp_path: Path) -> None:
    sink = LogAuditSink(ListLogger(), ListLogger())
    first = AuditFile(str(tmp_path / "1.jsonl"), 1 << 20, 1)
    sink.set_file(first)
    log = AuditLog(sink)
    log.record("eviction_done", pod="a")
    sink.set_file(AuditFile(str(tmp_path / "2.jsonl"), 1 << 20, 1))
    log.record("eviction_done", pod="b")
    assert sink.file is not None
    assert sink.file.path == str(tmp_path / "2.jsonl")
    sink.set_file(None)
    assert [r["pod"] for r in read_lines(tmp_path / "1.jsonl")] == ["a"]
    assert [r["pod"] for r in read_lines(tmp_path / "2.jsonl")] == ["b"]
    with pytest.raises(ValueError, match="closed"):
        first.write({"late": True})


def test_json_text_renders_what_orjson_refuses() -> None:
    record = {"big": 1 << 70, "text": "bad \udc80 surrogate", "levels": frozenset({"b", "a"})}
    assert json.loads(json_text(record)) == {
        "big": 1 << 70, "text": "bad \udc80 surrogate", "levels": ["a", "b"]}
    fast = {"pod": "ns/ä", "n": 3, "fields": ("x",), "mapping": MappingProxyType({"k": 1})}
    assert json.loads(json_text(fast)) == {"pod": "ns/ä", "n": 3, "fields": ["x"],
                                           "mapping": {"k": 1}}


def test_records_about_a_pod_are_given_its_whole_identity() -> None:
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    known = {"u-1": ("u-1", "shop", "web-0")}

    def identity(fields: Mapping[str, Any]) -> Mapping[str, str]:
        uid = fields.get("pod_uid")
        found = known.get(str(uid)) if uid else next(
            (v for v in known.values() if f"{v[1]}/{v[2]}" == fields.get("pod")), None)
        if found is None:
            return {}
        return {"pod_uid": found[0], "pod_namespace": found[1], "pod_name": found[2]}

    audit.identify(identity)
    audit.record("resctrl_fallback", pod_uid="u-1", group="g", reason="r")
    audit.record("eviction_done", pod="shop/web-0")
    audit.record("resctrl_fallback", pod_uid="u-gone", group="g", reason="r")
    audit.record("cgroup_write", path="/p", value="1", reason="r")
    assert [dict(fields) for _, fields in sink.records] == [
        {"pod_uid": "u-1", "pod_namespace": "shop", "pod_name": "web-0", "group": "g",
         "reason": "r"},
        {"pod_uid": "u-1", "pod_namespace": "shop", "pod_name": "web-0", "pod": "shop/web-0"},
        {"pod_uid": "u-gone", "group": "g", "reason": "r"},
        {"path": "/p", "value": "1", "reason": "r"},
    ]
