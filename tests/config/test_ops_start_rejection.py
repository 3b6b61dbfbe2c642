"""A configuration refused at start: the record says what happens then, which is not what a
refused reload does (no earlier configuration is there to stay in force)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.loader import ConfigError
from nri_plugin.config.store import ConfigStore


def test_a_file_refused_at_start_is_not_said_to_leave_an_earlier_configuration_in_force(
        tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[plugin\n")
    sink = MemoryAuditSink()
    with pytest.raises(ConfigError):
        ConfigStore(AuditLog(sink)).load_initial(str(path))
    (rejected,) = sink.named("config_rejected")
    assert "previous configuration" not in rejected["hint"]
    assert "no configuration is in force" in rejected["hint"]
    assert "nri-qos check-config" in rejected["hint"]
