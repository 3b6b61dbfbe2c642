"""The one switch for enforcement: `[agent] mode`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog
from nri_plugin.config.loader import ConfigError, parse_toml
from nri_plugin.config.schema import Config, in_force
from nri_plugin.config.store import ConfigStore
from reconciler.host.sysfs import Outcome, SysFs


class Records:
    def __init__(self) -> None:
        self.records: list[tuple[str, Mapping[str, Any]]] = []

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None:
        self.records.append((event, fields))


def test_the_embedded_defaults_observe() -> None:
    assert Config().agent.mode == "observe"


def test_observe_holds_every_action_in_dry_run_whatever_the_rungs_say() -> None:
    cfg = parse_toml(Config, "[eviction]\ndry_run = false\n[mitigation.evict]\ndry_run = false\n")
    held = in_force(cfg)
    rungs = held.mitigation
    assert (rungs.taint.dry_run, rungs.tune.dry_run, rungs.drop_cache.dry_run,
            rungs.evict.dry_run, held.eviction.dry_run) == (True, True, True, True, True)


def test_enforce_keeps_each_rungs_own_dry_run() -> None:
    cfg = parse_toml(Config, '[agent]\nmode = "enforce"\n[mitigation.tune]\ndry_run = true\n')
    held = in_force(cfg)
    assert held is cfg
    assert held.mitigation.tune.dry_run
    assert not held.mitigation.taint.dry_run
    assert held.eviction.dry_run  # its own default


def test_the_store_follows_a_reloaded_mode(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[agent]\nmode = "observe"\n')
    store = ConfigStore(AuditLog(Records()))
    store.load_initial(str(path))
    assert store.current.mitigation.taint.dry_run is False
    assert store.in_force.mitigation.taint.dry_run is True
    path.write_text('[agent]\nmode = "enforce"\n')
    assert store.reload()
    assert store.in_force.mitigation.taint.dry_run is False


def test_an_unknown_mode_is_refused_with_its_key() -> None:
    with pytest.raises(ConfigError, match=r"agent\.mode: must be one of observe, enforce"):
        parse_toml(Config, '[agent]\nmode = "live"\n')


def test_sysfs_in_observe_mode_writes_nothing_and_audits_each_value_once(tmp_path: Path) -> None:
    target = tmp_path / "sys/fs/cgroup/x"
    target.mkdir(parents=True)
    (target / "memory.high").write_text("max\n")
    (target / "tasks").write_text("")
    records = Records()
    observing = [True]
    sysfs = SysFs(tmp_path, AuditLog(records)).observing(lambda: observing[0])
    path = "/sys/fs/cgroup/x/memory.high"
    assert sysfs.write_if_changed(path, "1000", "test") is Outcome.OBSERVED
    assert sysfs.write_if_changed(path, "1000", "test") is Outcome.OBSERVED
    assert sysfs.write_if_changed(path, "2000", "test") is Outcome.OBSERVED
    assert sysfs.append_ids("/sys/fs/cgroup/x/tasks", [7, 8]) == 0
    assert sysfs.write_bounded(path, "3000", 1.0)[0] is Outcome.OBSERVED
    assert (target / "memory.high").read_text() == "max\n"
    assert (target / "tasks").read_text() == ""
    assert [(e, f["value"]) for e, f in records.records] == [
        ("write_observed", "1000"), ("write_observed", "2000"), ("write_observed", "7 8"),
        ("write_observed", "3000")]
    # Switched to enforce (a reload): the same object writes.
    observing[0] = False
    assert sysfs.write_if_changed(path, "1000", "test") is Outcome.WRITTEN
    assert (target / "memory.high").read_text() == "1000"


def probe_json(config: Path) -> dict[str, Any]:
    done = subprocess.run([str(Path(sys.executable).with_name("nri-qos")), "probe", "--json",
                           "--config", str(config)], capture_output=True, text=True,
                          timeout=120, check=True)
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def test_probe_reports_the_mode_and_the_actions_as_they_would_run(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[agent]\nmode = "observe"\n')
    observing = probe_json(config)
    assert observing["mode"] == "observe"
    assert observing["features"]["mitigation.tune"]["detail"].startswith("dry-run")
    config.write_text('[agent]\nmode = "enforce"\n')
    enforcing = probe_json(config)
    assert enforcing["mode"] == "enforce"
    assert not enforcing["features"]["mitigation.tune"]["detail"].startswith("dry-run")
    done = subprocess.run([str(Path(sys.executable).with_name("nri-qos")), "probe",
                           "--config", str(config)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert "mode              enforce\n" in done.stdout
    # Sizes for people.
    assert "iB for node-wide limits" in done.stdout
