"""The agent as the daemon builds it reads this boot's id under its root, so a state file written
in an earlier boot loses its notes of cgroup files when the agent starts, and keeps the rest."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.agent import build_agent, probe
from nri_plugin.config.store import ConfigStore
from nri_plugin.session.stub import PluginIdentity
from reconciler.host.statefile import BOOT_ID, STATE_FILE
from reconciler.loops.memory_guard import NOTES as GUARD_NOTES
from reconciler.mitigation.actions import TAINT_NOTES
from tests.support.fakesys import GIB, FakeHost


def test_the_agent_drops_an_earlier_boots_notes_of_cgroup_files_at_start(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host", version=2, driver="cgroupfs")
    host.set_numa([(8 * GIB, 16 * GIB, 100)])
    (host.root / BOOT_ID.lstrip("/")).parent.mkdir(parents=True)
    (host.root / BOOT_ID.lstrip("/")).write_text(f"{uuid.uuid4()}\n")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    tier = "/sys/fs/cgroup/kubepods/besteffort/memory.max"
    (state_dir / STATE_FILE).write_text(json.dumps({
        GUARD_NOTES: {tier: "max"}, TAINT_NOTES: {"nri-qos.io/pressure": "NoSchedule"},
        "boot_id": str(uuid.uuid4())}))
    config = tmp_path / "config.toml"
    config.write_text(
        f'[reconciler]\nroot = "{host.root}"\nstate_dir = "{state_dir}"\n'
        'cgroup_driver = "cgroupfs"\n[resctrl]\nenabled = false\n[kubernetes]\nenabled = false\n'
        "[status]\nenabled = false\n[metrics]\nenabled = false\n")
    audit = AuditLog(MemoryAuditSink())
    store = ConfigStore(audit)
    store.load_initial(config)
    found, sysfs = probe(store.current, audit)
    with capture_logs() as logs:
        build_agent(store, audit, found, sysfs, PluginIdentity("nri-qos", "10"),
                    run_background=True)
    [dropped] = [e for e in logs if e["event"] == "state_notes_of_an_earlier_boot"]
    assert dropped["dropped"] == {GUARD_NOTES: 1}
    assert TAINT_NOTES in dropped["kept"]
