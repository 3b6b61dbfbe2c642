"""``nri-qos reset`` on a node whose state file it cannot use: the uninstall must not report
"nothing to undo" of notes it could not read."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.cli.reset import main_reset, reset
from nri_plugin.config.schema import Config
from reconciler.host.statefile import STATE_FILE
from reconciler.loops.memory_guard import NOTES as GUARD_NOTES
from reconciler.mitigation.actions import TAINT_NOTES

TIER = "/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice/memory.max"


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    for host_dir in ("sys/fs/cgroup", "proc"):
        (tmp_path / "host" / host_dir).mkdir(parents=True)
    base = Config()
    return dataclasses.replace(
        base,
        reconciler=dataclasses.replace(base.reconciler, root=str(tmp_path / "host"),
                                       state_dir=str(tmp_path / "state")),
        status=dataclasses.replace(base.status, socket=str(tmp_path / "status.sock")))


def _reset(cfg: Config, *, dry_run: bool = False) -> tuple[int, str]:
    out = io.StringIO()
    code = reset(cfg, AuditLog(MemoryAuditSink()), dry_run=dry_run, out=out, kubernetes=False)
    return code, out.getvalue()


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_state_file_that_cannot_be_read_fails_the_reset_and_stays(
        cfg: Config, dry_run: bool) -> None:
    path = Path(cfg.reconciler.state_dir) / STATE_FILE
    path.mkdir(parents=True)  # read(2) fails on it, as on a file the LSM denies
    code, out = _reset(cfg, dry_run=dry_run)
    assert code == 1, out
    assert "nothing to undo" not in out
    assert f"cannot read the state file {path}" in out
    assert path.is_dir()


def test_an_invalid_state_file_is_said_to_be_set_aside_with_what_it_noted(cfg: Config) -> None:
    path = Path(cfg.reconciler.state_dir) / STATE_FILE
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({GUARD_NOTES: {TIER: "max"}})[:-2])
    code, out = _reset(cfg, dry_run=True)
    assert code == 0
    assert f"note: the state file {path} is invalid" in out, out
    assert "a reset sets it aside" in out
    code, out = _reset(cfg)
    assert code == 0
    assert f"set aside as {path}.bad: what it noted is not undone" in out, out
    assert Path(f"{path}.bad").exists()


@pytest.mark.parametrize("root", ["missing", "empty"])
def test_a_root_that_does_not_reach_the_host_fails_the_reset_and_keeps_the_notes(
        cfg: Config, tmp_path: Path, root: str) -> None:
    """Every noted file would look gone below such a root, and its note be dropped as that of a
    container gone meanwhile: the cap on the tier would stay, and nothing would say so."""
    (tmp_path / "empty").mkdir()
    cfg = dataclasses.replace(cfg, reconciler=dataclasses.replace(
        cfg.reconciler, root=str(tmp_path / root)))
    path = Path(cfg.reconciler.state_dir) / STATE_FILE
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({GUARD_NOTES: {TIER: "max"}}))
    code, out = _reset(cfg)
    assert code == 1, out
    assert f"[reconciler] root = {tmp_path / root} does not reach the host" in out
    assert json.loads(path.read_text()) == {GUARD_NOTES: {TIER: "max"}}


def test_a_taint_noted_but_out_of_the_apis_reach_fails_the_reset_and_stays_noted(
        cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``[kubernetes] enabled`` with no credentials: a taint an earlier run placed is named, and
    the reset does not pass for done ("nothing to undo", exit 0) with it on the node."""
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBECONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.setenv("NODE_NAME", "node-a")
    cfg = dataclasses.replace(cfg, kubernetes=dataclasses.replace(cfg.kubernetes, enabled=True))
    path = Path(cfg.reconciler.state_dir) / STATE_FILE
    path.parent.mkdir(parents=True)
    noted = {TAINT_NOTES: {"nri-qos.io/memory-pressure": "NoSchedule"}}
    path.write_text(json.dumps(noted))
    out = io.StringIO()
    code = reset(cfg, AuditLog(MemoryAuditSink()), dry_run=False, out=out)
    assert code == 1, out.getvalue()
    assert "nothing to undo" not in out.getvalue()
    assert "taint nri-qos.io/memory-pressure" in out.getvalue()
    assert json.loads(path.read_text()) == noted


def test_a_configuration_without_the_status_socket_says_a_running_agent_goes_unseen(
        cfg: Config, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[reconciler]\nroot = "{cfg.reconciler.root}"\n'
                      f'state_dir = "{cfg.reconciler.state_dir}"\n'
                      f'[status]\nenabled = false\nsocket = "{cfg.status.socket}"\n'
                      "[kubernetes]\nenabled = false\n")
    out, err = io.StringIO(), io.StringIO()
    assert main_reset(str(config), dry_run=True, out=out, err=err) == 0, err.getvalue()
    assert out.getvalue().splitlines()[0] == (
        "note: [status] enabled is false: whether an agent still runs cannot be told; stop it "
        "first (it would place what the reset takes away again)")
