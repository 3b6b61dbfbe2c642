"""The agent run by a user the runtime's NRI socket refuses: the log says to run it as root,
not that containerd may be missing NRI (the socket is there, NRI on)."""

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

import pytest

from tests.support.paths import REPO

NOBODY = 65534


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another user can read (pytest's own are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="nri-qos-ops-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv, to run the agent as another user")
def test_a_socket_the_user_may_not_open_is_said_to_need_root(shared_dir: Path) -> None:
    nri = shared_dir / "nri.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as runtime:
        runtime.bind(str(nri))
        nri.chmod(0o600)  # as containerd makes it: root's
        runtime.listen()
        config = shared_dir / "config.toml"
        config.write_text("[plugin]\nreconnect_initial_ms = 10\nreconnect_max_ms = 20\n"
                          '[reconciler]\nenabled = false\nstate_dir = ""\n'
                          "[resctrl]\nenabled = false\n[status]\nenabled = false\n")
        config.chmod(0o644)
        agent = subprocess.Popen(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
             sys.executable, "-m", "nri_plugin", "run", "--config", str(config),
             "--nri-socket", str(nri)],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        try:
            assert agent.stderr is not None
            for line in agent.stderr:
                record = json.loads(line)
                if record.get("event") == "runtime_socket_unavailable":
                    break
            else:
                pytest.fail("the agent ended without trying the socket")
        finally:
            agent.kill()
            agent.communicate(timeout=30)
    assert "Permission denied" in record["error"]
    assert "disable = false" not in record["hint"]
    assert "root" in record["hint"]
