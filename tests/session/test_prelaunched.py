"""Pre-launched mode: the daemon as a child process on an inherited socketpair end."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest

from nri_plugin.connection import (
    ENV_INDEX,
    ENV_NAME,
    ENV_SOCKET,
    MAX_FD,
    Prelaunched,
    take_prelaunched_env,
)
from tests.support.paths import REPO
from tests.support.prelaunch import create_one_container_then_go


@pytest.mark.parametrize("name", ["nri-qos", "10-nri-qos"])
async def test_prelaunched_plugin_serves_inherited_socket(tmp_path: Path, name: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[resctrl]\nenabled = false\n[status]\nenabled = false\n")
    runtime_end, plugin_end = socket.socketpair()
    fd = plugin_end.fileno()
    # The runtime passes exactly these three variables, nothing else.
    env = {ENV_SOCKET: str(fd), ENV_NAME: name, ENV_INDEX: "10"}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nri_plugin", "run", "--config", str(config),
        "--log-level", "warning", pass_fds=(fd,), env=env, cwd=REPO,
        stderr=asyncio.subprocess.PIPE,
    )
    plugin_end.close()
    try:
        await create_one_container_then_go(runtime_end, tmp_path)
    finally:
        async with asyncio.timeout(30):
            _, stderr = await child.communicate()
    assert child.returncode == 0, stderr.decode()


def test_take_prelaunched_env_reads_and_removes() -> None:
    environ = {ENV_SOCKET: "3", ENV_NAME: "05-nri-qos", ENV_INDEX: "05", "PATH": "/bin"}
    assert take_prelaunched_env(environ) == Prelaunched(3, "nri-qos", "05")
    assert environ == {"PATH": "/bin"}


def test_take_prelaunched_env_index_from_old_style_name() -> None:
    # NRI 0.3 passed the full file name; the index then comes from it.
    assert take_prelaunched_env({ENV_SOCKET: "4", ENV_NAME: "42-x"}) == Prelaunched(4, "x", "42")


def test_take_prelaunched_env_absent_or_invalid() -> None:
    assert take_prelaunched_env({"HOME": "/root"}) is None
    with pytest.raises(ValueError, match="not a file descriptor"):
        take_prelaunched_env({ENV_SOCKET: "three"})


@pytest.mark.parametrize("fd_text", [
    str(MAX_FD + 1), str(2**64), "9" * 5000, "0" * 11 + "3", "²", "٣", "-3", "",
])
def test_take_prelaunched_env_refuses_what_no_descriptor_is(fd_text: str) -> None:
    # Said at start (exit 2, prelaunched_env_invalid), not raised later from socket.socket().
    with pytest.raises(ValueError, match="not a file descriptor"):
        take_prelaunched_env({ENV_SOCKET: fd_text, ENV_NAME: "nri-qos", ENV_INDEX: "10"})
    assert take_prelaunched_env({ENV_SOCKET: str(MAX_FD)}) == Prelaunched(MAX_FD, "", "")


async def test_unusable_inherited_socket_ends_the_daemon(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[resctrl]\nenabled = false\n[status]\nenabled = false\n")
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nri_plugin", "run", "--config", str(config),
        env={ENV_SOCKET: "97", ENV_NAME: "nri-qos", ENV_INDEX: "10"}, cwd=REPO,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        _, stderr = await child.communicate()
    assert child.returncode == 1
    assert b"inherited_socket_unusable" in stderr
