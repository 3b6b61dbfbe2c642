"""Logging setup: renderers, levels, bound context, audit lines and file."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import structlog

from nri_plugin.obs.log_context import bound_fields, current_fields, merge_fields
from nri_plugin.obs.logs import (
    LoggingConfig,
    LoggingSetup,
)
from nri_plugin.session.chain import run_threaded

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
EVENT_FIELDS = {"nri_event": "create_container", "pod_namespace": "shop", "pod_name": "web-0",
                "pod_uid": "uid-1", "container": "nginx"}


@pytest.fixture
def make_setup() -> Iterator[Callable[..., LoggingSetup]]:
    made: list[LoggingSetup] = []

    def make(cfg: LoggingConfig | None = None, **kwargs: Any) -> LoggingSetup:
        setup = LoggingSetup(cfg, **kwargs)
        made.append(setup)
        return setup

    yield make
    for setup in made:
        setup.close()
    structlog.reset_defaults()


def json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_when_the_stream_is_not_a_terminal(make_setup: Callable[..., LoggingSetup]) -> None:
    out = io.StringIO()
    make_setup(stream=out)
    structlog.get_logger("nri_qos.test").info("hello", n=1)
    (line,) = json_lines(out)
    assert list(line)[:4] == ["timestamp", "level", "logger", "event"]
    assert ISO_UTC.match(line["timestamp"])
    assert line == {"timestamp": line["timestamp"], "level": "info", "logger": "nri_qos.test",
                    "event": "hello", "n": 1}


def test_console_on_a_terminal(make_setup: Callable[..., LoggingSetup]) -> None:
    primary, secondary = os.openpty()
    with open(secondary, "w", encoding="utf-8", closefd=True) as tty, \
            open(primary, "rb", buffering=0, closefd=True) as reader:
        make_setup(stream=tty)
        structlog.get_logger("nri_qos.test").info("hello", n=1)
        raw = reader.read(4096).decode()
    text = re.sub(r"\x1b\[[0-9;]*m", "", raw)
    assert raw != text  # coloured, for a terminal
    assert "hello" in text
    assert "n=1" in text
    assert not text.lstrip().startswith("{")


@pytest.mark.parametrize(("fmt", "is_json"), [("json", True), ("console", False)])
def test_format_setting_wins_over_detection(
    make_setup: Callable[..., LoggingSetup], fmt: str, is_json: bool
) -> None:
    out = io.StringIO()
    make_setup(LoggingConfig(format=fmt), stream=out)
    structlog.get_logger().warning("x")
    assert out.getvalue().startswith("{") is is_json


def test_level_filtering_and_override(make_setup: Callable[..., LoggingSetup]) -> None:
    out = io.StringIO()
    setup = make_setup(LoggingConfig(level="warning"), stream=out)
    log = structlog.get_logger("nri_qos.test")
    log.info("hidden")
    log.warning("shown")
    setup.apply(LoggingConfig(level="debug"))
    log.debug("now shown")
    assert [r["event"] for r in json_lines(out)] == ["shown", "now shown"]

    out2 = io.StringIO()
    pinned = make_setup(LoggingConfig(level="debug"), level="error", stream=out2)
    log.warning("hidden by the override")
    pinned.apply(LoggingConfig(level="debug"))  # a reload does not undo --log-level
    log.warning("still hidden")
    log.error("shown")
    assert pinned.level == "error"
    assert [r["event"] for r in json_lines(out2)] == ["shown"]


def test_unknown_level_override_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        LoggingSetup(level="loud", stream=io.StringIO())


def test_bound_fields_reach_every_line_of_the_block(
    make_setup: Callable[..., LoggingSetup],
) -> None:
    out = io.StringIO()
    make_setup(stream=out)
    log = structlog.get_logger()
    with bound_fields(EVENT_FIELDS):
        log.info("inside")
    log.info("outside")
    inside, outside = json_lines(out)
    assert {k: inside[k] for k in ("nri_event", "pod_namespace", "pod_name", "pod_uid",
                                   "container")} == {
        "nri_event": "create_container", "pod_namespace": "shop", "pod_name": "web-0",
        "pod_uid": "uid-1", "container": "nginx"}
    assert "nri_event" not in outside


def test_audit_records_bypass_the_level_and_carry_the_context(
    make_setup: Callable[..., LoggingSetup],
) -> None:
    out = io.StringIO()
    setup = make_setup(LoggingConfig(level="error"), stream=out)
    with bound_fields({"nri_event": "create_container", "pod_uid": "uid-1"}):
        setup.audit.record("adjustment_applied", pod_uid="uid-1", container="nginx",
                           qos_level="reclaimed_cores", fields=("memory_high",))
    (line,) = json_lines(out)
    assert line["audit"] is True
    assert line["logger"] == "nri_qos.audit"
    assert line["event"] == "adjustment_applied"
    assert line["qos_level"] == "reclaimed_cores"
    assert line["level"] == "info"  # the record's own level, not the log filter's
    assert line["fields"] == ["memory_high"]
    assert line["nri_event"] == "create_container"
    assert ISO_UTC.match(line["timestamp"])


def test_every_audit_line_has_a_level_and_a_rejected_config_is_an_error(
    make_setup: Callable[..., LoggingSetup],
) -> None:
    out = io.StringIO()
    setup = make_setup(LoggingConfig(level="info"), stream=out)
    setup.audit.record("config_rejected", source="/etc/nri-qos/config.toml", errors=["x"])
    setup.audit.record("cgroup_write_failed", path="/p", value="1", reason="r", error="EACCES")
    setup.audit.record("cgroup_write", path="/p", value="1", reason="r")
    assert [(line["event"], line["level"]) for line in json_lines(out)] == [
        ("config_rejected", "error"), ("cgroup_write_failed", "warning"),
        ("cgroup_write", "info")]


def test_audit_file_follows_the_configuration(
    make_setup: Callable[..., LoggingSetup], tmp_path: Path
) -> None:
    out = io.StringIO()
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    setup = make_setup(LoggingConfig(audit_file=str(first)), stream=out)
    setup.audit.record("config_loaded", source="one")
    setup.apply(LoggingConfig(audit_file=str(first)))  # unchanged: same file stays open
    setup.audit.record("config_loaded", source="two")
    setup.apply(LoggingConfig(audit_file=str(second), audit_max_bytes=4096, audit_backups=1))
    setup.audit.record("config_loaded", source="three")
    setup.apply(LoggingConfig())
    setup.audit.record("config_loaded", source="four")

    def sources(path: Path) -> list[str]:
        return [json.loads(line)["source"] for line in path.read_text().splitlines()]

    assert sources(first) == ["one", "two"]
    assert sources(second) == ["three"]
    assert [r["source"] for r in json_lines(out)] == ["one", "two", "three", "four"]


def test_unopenable_audit_file_fails_open(
    make_setup: Callable[..., LoggingSetup], tmp_path: Path
) -> None:
    out = io.StringIO()
    missing = tmp_path / "no-such-dir" / "audit.jsonl"
    setup = make_setup(LoggingConfig(audit_file=str(missing)), stream=out)
    setup.audit.record("eviction_done", pod="ns/p")
    problem, record = json_lines(out)
    assert problem["event"] == "audit_file_unavailable"
    assert problem["level"] == "error"
    assert problem["path"] == str(missing)
    assert record["event"] == "eviction_done"
    assert setup.sink.file is None
    # A reload of the same configuration (SIGHUP) after the directory is made opens it.
    missing.parent.mkdir()
    setup.retry_file()
    setup.audit.record("eviction_done", pod="ns/q")
    assert [json.loads(line)["pod"] for line in missing.read_text().splitlines()] == ["ns/q"]
    setup.retry_file()  # open: nothing more to try
    assert setup.sink.file is not None


def test_standard_library_logging_is_routed(make_setup: Callable[..., LoggingSetup]) -> None:
    out = io.StringIO()
    setup = make_setup(stream=out)
    logging.getLogger("asyncio").warning("loop %s", "trouble")
    logging.getLogger("asyncio").debug("filtered")
    (line,) = json_lines(out)
    assert line["event"] == "loop trouble"
    assert line["logger"] == "asyncio"
    assert line["level"] == "warning"
    setup.close()
    logging.getLogger("asyncio").warning("after close")
    assert len(json_lines(out)) == 1


def test_values_json_cannot_encode_are_rendered(make_setup: Callable[..., LoggingSetup]) -> None:
    from types import MappingProxyType

    out = io.StringIO()
    make_setup(stream=out)
    structlog.get_logger().info("values", m=MappingProxyType({"a": 1}), s=frozenset({"b", "a"}),
                                p=Path("/x"))
    (line,) = json_lines(out)
    assert (line["m"], line["s"], line["p"]) == ({"a": 1}, ["a", "b"], "/x")


def test_close_puts_structlog_back(make_setup: Callable[..., LoggingSetup]) -> None:
    from structlog.testing import capture_logs

    setup = make_setup(LoggingConfig(level="error"), stream=io.StringIO())
    setup.close()
    with capture_logs() as logs:
        structlog.get_logger().info("seen again")
    assert [e["event"] for e in logs] == ["seen again"]


def test_default_stream_follows_sys_stderr(
    make_setup: Callable[..., LoggingSetup], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_setup()
    later = io.StringIO()
    monkeypatch.setattr("sys.stderr", later)
    structlog.get_logger().warning("to the current stderr")
    logging.getLogger("x").warning("stdlib too")
    assert [r["event"] for r in json_lines(later)] == ["to the current stderr", "stdlib too"]


def test_nested_event_fields_and_their_reset() -> None:
    with bound_fields({"nri_event": "outer", "pod_uid": "u1"}):
        with bound_fields({"nri_event": "inner", "container": "c"}):
            assert dict(current_fields()) == {"nri_event": "inner", "pod_uid": "u1",
                                              "container": "c"}
            line = merge_fields(None, "info", {"event": "x", "container": "given"})
            # What the log call passes itself wins over the context.
            assert line == {"event": "x", "container": "given", "nri_event": "inner",
                            "pod_uid": "u1"}
        assert dict(current_fields()) == {"nri_event": "outer", "pod_uid": "u1"}
    assert dict(current_fields()) == {}


async def test_a_capability_in_a_worker_thread_sees_the_event_fields() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def capability() -> None:
        seen.append((threading.current_thread().name, dict(current_fields())))

    fields = {"nri_event": "run_pod_sandbox", "pod_uid": "u1"}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker") as executor, \
            bound_fields(fields):
        outcome = await run_threaded([("c", capability)], executor, deadline_ms=5000)
    assert outcome.complete
    assert seen == [("worker_0", fields)]
