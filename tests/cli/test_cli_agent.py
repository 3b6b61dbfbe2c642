"""The installed ``nri-qos`` command against a running agent, as an operator types it: which
socket is which, a second agent, JSON when nothing answers, a reader that goes away early."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

NRI_QOS = str(Path(sys.executable).with_name("nri-qos"))


def nri_qos(*args: str, stdout: int | None = subprocess.PIPE,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NRI_QOS, *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=timeout, check=False)


class Agent:
    """``nri-qos run`` in the background: no runtime on its NRI socket (it keeps retrying), its
    status socket in a directory of the test's."""

    def __init__(self, directory: Path) -> None:
        self.config = directory / "config.toml"
        self.status_socket = directory / "run" / "status.sock"
        self.nri_socket = directory / "nri.sock"
        self.config.write_text(
            f'[status]\nsocket = "{self.status_socket}"\n'
            "[reconciler]\nenabled = false\n[kubernetes]\nenabled = false\n"
            "[resctrl]\nenabled = false\n")

    def start(self, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [NRI_QOS, "run", "--config", str(self.config), "--nri-socket", str(self.nri_socket),
             "--log-level", "warning", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_answering(self, process: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + 30
        while nri_qos("status", "--config", str(self.config), "--json").returncode != 0:
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the agent never answered"
            time.sleep(0.1)


def said_until(process: subprocess.Popen[str], needle: str, timeout_s: float) -> str:
    """What the process wrote on stderr until a line with ``needle`` (or ``timeout_s``): an
    agent starting on a busy machine says it later than on a quiet one."""
    lines: list[str] = []

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if needle in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    return "".join(lines)


def stop(process: subprocess.Popen[str]) -> str:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    return err


@pytest.fixture
def agent(short_dir: Path) -> Iterator[tuple[Agent, subprocess.Popen[str]]]:
    found = Agent(short_dir)
    process = found.start()
    try:
        found.wait_answering(process)
        yield found, process
    finally:
        stop(process)


def test_status_finds_the_agent_from_its_config(agent: tuple[Agent, subprocess.Popen[str]]
                                                ) -> None:
    found, _ = agent
    done = nri_qos("status", "--config", str(found.config))
    assert done.returncode == 0, done.stderr
    assert "connection        disconnected" in done.stdout
    done = nri_qos("status", "--status-socket", str(found.status_socket), "--json")
    assert json.loads(done.stdout)["agent"]["mode"] == "observe"


def test_the_nri_socket_is_not_the_status_socket(agent: tuple[Agent, subprocess.Popen[str]]
                                                 ) -> None:
    found, _ = agent
    done = nri_qos("status", "--status-socket", str(found.nri_socket))
    assert done.returncode == 1
    assert "--config PATH or --status-socket PATH" in done.stderr
    assert "not the NRI socket of `run --nri-socket`" in done.stderr
    # status has no --socket: one name would mean two sockets.
    assert nri_qos("status", "--socket", str(found.status_socket)).returncode == 2


def test_a_second_agent_refuses_to_start(agent: tuple[Agent, subprocess.Popen[str]]) -> None:
    found, first = agent
    second = found.start()
    try:
        assert second.wait(timeout=30) == 1
    finally:
        err = stop(second)
    assert "agent_already_running" in err
    assert "--allow-second-agent" in err
    assert first.poll() is None
    # Told otherwise, it starts (and leaves the first one's status socket alone).
    forced = found.start("--allow-second-agent")
    said = ""
    try:
        said = said_until(forced, "status_unavailable", 30.0)
        assert forced.poll() is None
    finally:
        said += stop(forced)
    assert "status_unavailable" in said
    assert nri_qos("status", "--config", str(found.config)).returncode == 0


def test_status_json_without_an_agent_is_json(short_dir: Path) -> None:
    done = nri_qos("status", "--status-socket", str(short_dir / "absent.sock"), "--json")
    assert done.returncode == 1
    answer = json.loads(done.stdout)
    assert answer["running"] is False
    assert "no nri-qos agent is running" in answer["error"]


def answering_once(path: Path, answer: bytes) -> threading.Thread:
    """Something that is not the agent on its status socket: it writes ``answer`` to the first
    client and closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("answer", [b"{}", b'{"format": 1, "agent": []}', b'{"format": 1}'],
                         ids=["empty-object", "wrong-shape", "format-only"])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_status_refuses_a_json_object_that_is_not_a_status_document(
        short_dir: Path, answer: bytes, as_json: bool) -> None:
    path = short_dir / "status.sock"
    server = answering_once(path, answer)
    done = nri_qos("status", "--status-socket", str(path), *(["--json"] if as_json else []))
    server.join(5)
    assert "Traceback" not in done.stderr
    assert done.returncode == 1
    assert done.stderr.startswith(f"nri-qos status: the answer on {path} is not a status "
                                  "document"), done.stderr
    if as_json:  # still JSON, saying the agent's answer was not one
        failure = json.loads(done.stdout)
        assert (failure["running"], failure["socket"]) == (False, str(path))
        assert failure["error"].startswith(f"the answer on {path} is not a status document")
    else:
        assert done.stdout == ""


def closed_pipe() -> int:
    """The write end of a pipe whose reader is already gone: every write fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    return write


@pytest.mark.parametrize("args", [("default-config",), ("check-config",)])
def test_a_reader_going_away_ends_the_command_quietly(args: tuple[str, ...]) -> None:
    write = closed_pipe()
    try:
        done = nri_qos(*args, stdout=write)
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr
    assert "BrokenPipeError" not in done.stderr
    assert done.returncode == 128 + signal.SIGPIPE


def test_status_into_a_closed_pipe_is_quiet(agent: tuple[Agent, subprocess.Popen[str]]) -> None:
    found, _ = agent
    for _ in range(3):
        write = closed_pipe()
        try:
            done = nri_qos("status", "--config", str(found.config), stdout=write)
        finally:
            os.close(write)
        assert done.stderr == ""
        assert done.returncode == 128 + signal.SIGPIPE


def test_events_the_runtime_does_not_take_are_named() -> None:
    done = nri_qos("simulate", "--runtime", "containerd/v1.7.20", "--log-level", "warning")
    assert done.returncode == 0, done.stderr
    (line,) = [json.loads(x) for x in done.stderr.splitlines()
               if "events_unsupported_by_runtime" in x]
    assert line["dropped"] == ["update_pod_sandbox"]
    assert "create_container" in line["valid"]


def test_metrics_address_on_the_command_line_wins_over_the_config(short_dir: Path) -> None:
    found = Agent(short_dir)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with found.config.open("a") as config:
        config.write(f'[metrics]\nenabled = true\naddress = "127.0.0.1"\nport = {port}\n')
    process = found.start("--metrics-address", "127.0.0.2")
    try:
        found.wait_answering(process)
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.2", port), timeout=5) as conn:
                    conn.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
                    assert conn.recv(100).startswith(b"HTTP/1.1 200")
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        stop(process)
