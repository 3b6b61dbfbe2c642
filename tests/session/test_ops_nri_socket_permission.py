"""The agent refused by the runtime's NRI socket: the log says what the process lacks (to run as
root; as root, CAP_DAC_OVERRIDE or a security module's leave), not that containerd may be
missing NRI (the socket is there, NRI on). The agent runs as a process of its own, against a
real socket."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO

NOBODY = 65534
ROOT_AND_SETPRIV = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv, to run the agent with fewer rights")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another user can read (pytest's own are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="nri-qos-ops-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def _interpreter_for_nobody() -> bool:
    """Whether ``nobody`` can run the agent with this interpreter: the agent's whole import,
    its dependencies included (a virtualenv in a directory of root's alone, as CI makes one,
    keeps them out of its reach)."""
    found = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
         sys.executable, "-c", "import nri_plugin.agent, nri_plugin.cli.nri_qos"],
        cwd=REPO, capture_output=True, check=False)
    return found.returncode == 0


def _refused(shared_dir: Path, owner: int, rights: list[str]) -> dict[str, Any]:
    """The agent's ``runtime_socket_unavailable`` record, run through ``setpriv rights`` against
    a socket of ``owner``'s that only its owner may open, as containerd makes its own."""
    nri = shared_dir / "nri.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as runtime:
        runtime.bind(str(nri))
        nri.chmod(0o600)
        os.chown(nri, owner, owner)
        runtime.listen()
        config = shared_dir / "config.toml"
        config.write_text("[plugin]\nreconnect_initial_ms = 10\nreconnect_max_ms = 20\n"
                          '[reconciler]\nenabled = false\nstate_dir = ""\n'
                          "[resctrl]\nenabled = false\n[status]\nenabled = false\n"
                          "[metrics]\nenabled = false\n")
        config.chmod(0o644)
        agent = subprocess.Popen(
            ["setpriv", *rights, "--", sys.executable, "-m", "nri_plugin", "run", "--config",
             str(config), "--nri-socket", str(nri)],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        try:
            assert agent.stderr is not None
            lines = []
            for line in agent.stderr:
                lines.append(line)
                if not line.startswith("{"):
                    continue
                record: dict[str, Any] = json.loads(line)
                if record.get("event") == "runtime_socket_unavailable":
                    return record
            pytest.fail("the agent ended without trying the socket: " + "".join(lines[-20:]))
        finally:
            agent.kill()
            agent.communicate(timeout=30)


@ROOT_AND_SETPRIV
def test_a_socket_a_user_may_not_open_is_said_to_need_root(shared_dir: Path) -> None:
    if not _interpreter_for_nobody():
        pytest.skip("this interpreter is out of nobody's reach")
    record = _refused(shared_dir, 0, [f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                      "--clear-groups"])
    assert "Permission denied" in record["error"]
    assert "disable = false" not in record["hint"]
    assert "run nri-qos as root" in record["hint"]


@ROOT_AND_SETPRIV
def test_a_socket_root_may_not_open_is_said_to_need_dac_override(shared_dir: Path) -> None:
    # Root without CAP_DAC_OVERRIDE, as in a container that drops it, and a socket not root's.
    record = _refused(shared_dir, NOBODY,
                      ["--bounding-set=-dac_override,-dac_read_search"])
    assert "Permission denied" in record["error"]
    assert "disable = false" not in record["hint"]
    assert "CAP_DAC_OVERRIDE" in record["hint"]
