"""``nri-qos reset`` after the node rebooted: the cgroups the earlier boot's agent changed are
gone, and kubelet made them again with its own values; the API server's taint is still there."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.cli.reset import reset
from nri_plugin.config.schema import Config
from reconciler.host.statefile import BOOT_ID, STATE_FILE, state_file
from reconciler.loops.memory_guard import NOTES as GUARD_NOTES
from reconciler.mitigation.actions import TAINT_NOTES
from tests.support.tmpfs import tmpfs

TIER = "/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice"


def reset_on(host: Path, state_dir: Path, tmp_path: Path, out: io.StringIO) -> int:
    """``nri-qos reset`` of a host under ``host`` with its state file in ``state_dir``, no API
    server, its lines into ``out``."""
    base = Config()
    cfg = dataclasses.replace(
        base, reconciler=dataclasses.replace(base.reconciler, root=str(host),
                                             state_dir=str(state_dir)),
        status=dataclasses.replace(base.status, socket=str(tmp_path / "status.sock")))
    return reset(cfg, AuditLog(MemoryAuditSink()), dry_run=False, out=out, kubernetes=False)


def test_a_reset_after_a_reboot_leaves_kubelets_values_and_keeps_the_taint_noted(
        tmp_path: Path) -> None:
    host = tmp_path / "host"
    (host / "proc").mkdir(parents=True)
    tier = host / TIER.lstrip("/")
    tier.mkdir(parents=True)
    (tier / "memory.max").write_text(f"{8 << 30}\n")  # kubelet's, in the new boot
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (host / BOOT_ID.lstrip("/")).parent.mkdir(parents=True)
    (host / BOOT_ID.lstrip("/")).write_text(f"{uuid.uuid4()}\n")  # this boot, as the root says
    earlier = str(uuid.uuid4())
    (state_dir / STATE_FILE).write_text(json.dumps({
        GUARD_NOTES: {f"{TIER}/memory.max": "max"}, TAINT_NOTES: {"nri-qos.io/pressure": "x"},
        "boot_id": earlier}))
    out = io.StringIO()
    code = reset_on(host, state_dir, tmp_path, out)
    assert code == 0, out.getvalue()
    assert (tier / "memory.max").read_text().strip() == str(8 << 30)
    assert "written before the node's last boot" in out.getvalue()
    assert f"1 of {GUARD_NOTES}" in out.getvalue()
    assert state_file(str(state_dir), read_only=True).entries(TAINT_NOTES) == {
        "nri-qos.io/pressure": "x"}


def test_a_reset_says_which_notes_of_another_version_it_leaves(tmp_path: Path) -> None:
    host = tmp_path / "host"
    for below in ("proc", "sys/fs/cgroup"):
        (host / below).mkdir(parents=True)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    later = {f"{TIER}/memory.max": {"before": "max", "written": "1073741824"}}
    (state_dir / STATE_FILE).write_text(json.dumps({GUARD_NOTES: later}))
    out = io.StringIO()
    code = reset_on(host, state_dir, tmp_path, out)
    assert code == 0, out.getvalue()
    assert f"holds notes this version does not know (1 of {GUARD_NOTES})" in out.getvalue()
    assert json.loads((state_dir / STATE_FILE).read_text())[GUARD_NOTES] == later


@pytest.fixture
def read_only_state(tmp_path: Path) -> Iterator[Path]:
    """A state directory on a tmpfs of its own, made read-only once the test wrote its file."""
    with tmpfs(tmp_path / "state", "size=1m") as mnt:
        yield mnt


def test_a_reset_whose_state_file_cannot_be_written_fails_and_says_its_notes_stay(
        tmp_path: Path, read_only_state: Path) -> None:
    """Each note of what was undone stays in the file: a later agent would take it for an
    effect still on the node and write back its value from before, whatever the file holds by
    then."""
    host = tmp_path / "host"
    (host / "proc").mkdir(parents=True)
    tier = host / TIER.lstrip("/")
    tier.mkdir(parents=True)
    (tier / "memory.max").write_text(f"{1 << 30}\n")  # the guard's cap
    (read_only_state / STATE_FILE).write_text(json.dumps(
        {GUARD_NOTES: {f"{TIER}/memory.max": "max"}}))
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_state)], check=True)
    out = io.StringIO()
    code = reset_on(host, read_only_state, tmp_path, out)
    assert (tier / "memory.max").read_text().strip() == "max"
    assert code == 1, out.getvalue()
    assert f"failed: the state file {read_only_state / STATE_FILE} could not be written" \
        in out.getvalue()
