"""The audit records the docs show as examples are records the agent writes: a catalogue event
with its required fields and its own level, and an ``adjustment_applied`` naming the fields as the
answer's records name them."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from common.audit import AUDIT_LOGGER, CATALOGUE, level_of
from hooks.settings import ContainerSettings, HookStage, OciHookSpec
from nri_plugin.session.adjustment import set_fields
from tests.support.paths import REPO


def examples() -> list[tuple[str, dict[str, Any]]]:
    """(document, record) of every audit record written out as a JSON line in the docs."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for line in path.read_text(encoding="utf-8").splitlines():
            if re.match(r'\{"timestamp": ".*"audit": true', line):
                found.append((path.name, json.loads(line)))
    return found


def field_names() -> set[str]:
    """Every name ``adjustment_applied`` may list for a setting the policies decide."""
    everything = ContainerSettings(
        rdt_class="x", memory_limit=1, memory_reservation=1, oom_score_adj=1,
        unified={"memory.min": "1", "memory.low": "1", "memory.high": "1"},
        hooks=(OciHookSpec(stage=HookStage.PRESTART, path="/x"),))
    return set(set_fields(everything))


def test_the_docs_show_an_audit_record() -> None:
    assert "adjustment_applied" in {record["event"] for _, record in examples()}


@pytest.mark.parametrize(("doc", "record"), examples(),
                         ids=lambda v: v if isinstance(v, str) else v["event"])
def test_each_example_is_a_record_the_agent_writes(doc: str, record: dict[str, Any]) -> None:
    event = record["event"]
    assert event in CATALOGUE, doc
    assert record["logger"] == AUDIT_LOGGER
    assert record["level"] == level_of(event)
    assert set(CATALOGUE[event].required) <= set(record)
    if event == "adjustment_applied":
        assert set(record["fields"]) <= field_names(), record["fields"]
