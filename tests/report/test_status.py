"""``nri-qos status`` against a running agent driven by the runtime simulator, and without one."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from hooks.events import Event
from nri_plugin.cli import main
from nri_plugin.cli.status import main_status, print_status
from nri_plugin.config.schema import Config
from nri_plugin.report.status import StatusServer, ladder_sections
from nri_plugin.sim.simulator import RuntimeSimulator
from reconciler.detection.signals import NODE as NODE_SCOPE
from reconciler.detection.signals import Board, Level, Reading
from reconciler.kube import KubeActions, KubernetesConfig, build_api_client
from reconciler.mitigation.actions import TaintAction
from reconciler.mitigation.service import Mitigation
from tests.support.builders import LEVEL
from tests.support.eviction_env import NODE, forced, make_env
from tests.support.fake_apiserver import FakeApiServer, write_kubeconfig
from tests.support.fakesys import FakeHost, nri_messages
from tests.support.polling import eventually
from tests.support.serving import serving_daemon

UID_A = "0a0a0a0a-1111-2222-3333-444444444444"
UID_B = "0b0b0b0b-1111-2222-3333-444444444444"


async def status(path: Path, *, as_json: bool = True) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    # The command blocks on its socket; the agent answers from this test's event loop.
    code = await asyncio.to_thread(main_status, None, str(path), as_json=as_json, out=out,
                                   err=err)
    return code, out.getvalue(), err.getvalue()


async def document(path: Path) -> dict[str, Any]:
    code, out, err = await status(path)
    assert code == 0, err
    found: dict[str, Any] = json.loads(out)
    return found


async def test_status_of_a_running_agent(tmp_path: Path, short_dir: Path) -> None:
    root = tmp_path / "host"
    host = FakeHost(root)
    host.make_resctrl()
    existing = host.add_pod(UID_A, tier="besteffort", annotations={LEVEL: "reclaimed_cores"})
    created = host.add_pod(UID_B, tier="burstable")
    sock = short_dir / "run" / "status.sock"
    config = tmp_path / "config.toml"
    config.write_text(
        '[agent]\nmode = "enforce"\n'
        f'[reconciler]\nroot = "{root}"\nresctrl_interval_s = 0.1\ndrift_interval_s = 0.1\n'
        f'state_dir = "{tmp_path / "state"}"\n'
        "[memory_guard]\ninterval_s = 0.1\n[cpu_idle]\ninterval_s = 1\n[numa]\ninterval_s = 0.1\n"
        "[numa_balance]\ninterval_s = 0.1\n"
        f'[kubernetes]\nenabled = false\n[status]\nsocket = "{sock}"\n')
    pod_a, containers_a = nri_messages(existing)
    simulator = RuntimeSimulator(tmp_path / "nri.sock", pods=[pod_a], containers=containers_a)
    async with serving_daemon(config, simulator) as run:
        conn = run.connection
        pod_b, containers_b = nri_messages(created)
        await simulator.send(conn, Event.RUN_POD_SANDBOX, pod_b)
        await simulator.send(conn, Event.CREATE_CONTAINER, pod_b, containers_b[0])
        await simulator.send(conn, Event.START_CONTAINER, pod_b, containers_b[0])
        # Root only: the socket 0600 in a directory the agent made 0700.
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
        async with asyncio.timeout(15):
            while True:
                doc = await document(sock)
                loops = doc["reconciler"]["loops"]
                if len(loops) == 7 and all(loop["cycles"] >= 2 for loop in loops.values()):
                    break
                await asyncio.sleep(0.05)

        assert doc["format"] == 1
        assert doc["agent"]["plugin"] == "10-nri-qos"
        assert doc["agent"]["config"] == str(config)
        assert doc["agent"]["mode"] == "enforce"
        connection = doc["connection"]
        assert connection["state"] == "synchronized"
        assert connection["connections"] == 1
        assert 0 <= connection["for_s"] < 60
        runtime = doc["runtime"]
        assert (runtime["name"], runtime["version"]) == ("containerd",
                                                        simulator.runtime.version)
        assert runtime["nri_version"] == simulator.runtime.nri_version
        assert int(runtime["event_mask"], 16) == conn.events
        assert "create_container" in runtime["events"]
        features = doc["features"]
        assert features["resctrl"]["runs"] is True
        assert features["kubernetes"] == {
            "runs": False, "detail": "kubernetes.enabled is false: NRI data only"}
        # cgroup v1 without v1_reservation: memory QoS is off, and says why.
        assert features["memory_qos"]["runs"] is False
        assert "cgroup v1" in features["memory_qos"]["detail"]
        assert doc["node"]["pods"] == 2
        assert doc["node"]["containers"] == 2
        assert doc["node"]["running_containers"] == 2
        assert doc["node"]["pods_by_level"] == {"reclaimed_cores": 1, "shared_cores": 1}
        assert doc["reconciler"]["running"] is True
        assert set(loops) == {"resctrl_tasks", "drift", "memory_guard", "cpu_idle",
                              "numa_binding", "numa_balance", "offload"}
        assert all(loop["failures"] == 0 and loop["ago_s"] < 30 for loop in loops.values())
        # The fake host has no /proc/vmstat: the detector says it does not know, and why.
        kswapd = {(r["detector"], r["scope"]): r for r in doc["detection"]}[("kswapd", "node")]
        assert (kswapd["level"], kswapd["reason"]) == ("unknown", "/proc/vmstat is missing")
        ladder = doc["mitigation"]
        assert (ladder["level"], ladder["engaged"]) == ("none", [])
        # At start the ladder clears what an earlier run may have left; without the API the
        # taint rung can only say so.
        assert ladder["last"]["taint"]["result"] == "skipped"
        assert (doc["evictions"], doc["taints"]) == ([], [])

        code, text, _ = await status(sock, as_json=False)
        assert code == 0
        assert "connection        synchronized since " in text
        assert f"runtime           containerd {simulator.runtime.version}, NRI " in text
        assert f"events            {', '.join(runtime['events'])} (mask {runtime['event_mask']})" \
            in text
        assert "off memory_qos" in text
        assert "2 pods (1 reclaimed_cores, 1 shared_cores), 2 containers, 2 running" in text
        assert "  drift            last cycle " in text
        assert "mitigation ladder level none (level none: " in text
        assert "last evictions    none" in text
        assert "taints            none" in text
    assert run.status == 0
    # The agent took its socket away with it: the next question finds no agent.
    assert not sock.exists()
    code, out, err = await status(sock)
    assert code == 1
    assert json.loads(out)["running"] is False
    assert "no nri-qos agent is running" in err


def test_no_agent_is_a_clear_error(short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--status-socket", str(short_dir / "absent.sock")]) == 1
    err = capsys.readouterr().err
    assert "no nri-qos agent is running" in err
    assert "nri-qos run" in err
    assert "--status-socket PATH" in err
    assert "--config PATH" in err
    # A socket left behind by an agent that died: nothing answers either.
    stale = short_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(stale))
    assert main(["status", "--status-socket", str(stale), "--json"]) == 1
    captured = capsys.readouterr()
    assert "no nri-qos agent is running" in captured.err
    answer = json.loads(captured.out)
    assert answer["running"] is False
    assert answer["socket"] == str(stale)
    assert "no nri-qos agent is running" in answer["error"]


def test_socket_path_comes_from_the_config(short_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[status]\nsocket = "{short_dir}/from-config.sock"\n')
    assert main(["status", "--config", str(config)]) == 1
    assert f"{short_dir}/from-config.sock" in capsys.readouterr().err
    config.write_text('[status]\nsocket = "relative.sock"\n')
    assert main(["status", "--config", str(config)]) == 2
    assert "status.socket" in capsys.readouterr().err
    assert main(["status", "--config", str(config), "--json"]) == 2
    answer = json.loads(capsys.readouterr().out)
    assert answer["running"] is False
    assert "status.socket" in answer["error"]


async def test_a_second_agent_leaves_the_first_ones_socket_alone(short_dir: Path) -> None:
    path = short_dir / "status.sock"
    first = StatusServer(str(path), lambda: {"format": 1, "who": "first"})
    second = StatusServer(str(path), lambda: {"format": 1, "who": "second"})
    stop_first, stop_second = asyncio.Event(), asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(first.serve(stop_first))
        while not path.exists():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        with capture_logs() as logs:
            group.create_task(second.serve(stop_second))
            while not logs:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert logs[0]["event"] == "status_unavailable"
        assert "another agent answers" in logs[0]["error"]
        reader, writer = await asyncio.open_unix_connection(str(path))
        assert json.loads(await reader.read())["who"] == "first"
        writer.close()
        stop_second.set()
        stop_first.set()
    assert not path.exists()


async def test_stale_socket_is_replaced_and_other_files_are_not(short_dir: Path) -> None:
    path = short_dir / "status.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))
    server = StatusServer(str(path), lambda: {"format": 1})
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(server.serve(stop))
        async with asyncio.timeout(5):
            while True:
                try:
                    reader, writer = await asyncio.open_unix_connection(str(path))
                except ConnectionRefusedError:
                    await asyncio.sleep(0.01)
                    continue
                break
        assert json.loads(await reader.read()) == {"format": 1}
        writer.close()
        stop.set()
    # A regular file at the path is somebody's: reported, never removed.
    path.write_text("not a socket")
    stop = asyncio.Event()
    with capture_logs() as logs:
        async with asyncio.TaskGroup() as group:
            group.create_task(server.serve(stop))
            while not logs:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            stop.set()
    assert "is not a socket" in logs[0]["error"]
    assert path.read_text() == "not a socket"


async def test_a_failing_document_is_an_error_not_a_hang(short_dir: Path) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("no")

    path = short_dir / "status.sock"
    server = StatusServer(str(path), broken)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(server.serve(stop))
        while not path.exists():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        with capture_logs():
            code, _, err = await status(path)
        stop.set()
    assert code == 1
    assert "failed to assemble its status" in err


def test_printing_the_ladder_evictions_and_taints() -> None:
    doc: dict[str, Any] = {
        "agent": {"version": "1", "pid": 1, "plugin": "10-nri-qos", "uptime_s": 5,
                  "config": "embedded defaults", "mode": "observe"},
        "connection": {"state": "disconnected", "since_unix": 0, "for_s": 1.0, "connections": 0},
        "runtime": None, "features": {}, "node": {"pods": 0, "containers": 0,
                                                  "running_containers": 0, "pods_by_level": {},
                                                  "synchronized": False},
        "reconciler": {"running": False, "loops": {}},
        "detection": [{"detector": "psi", "scope": "node", "level": "high", "value": 50,
                       "threshold": 40, "unit": "percent", "reason": None},
                      {"detector": "system_free", "scope": "node", "level": "none",
                       "value": 19658117120.0, "threshold": 2147483648.0, "unit": "bytes",
                       "reason": None}],
        "mitigation": {"level": "medium",
                       "cause": "level medium: psi on node at 50 percent, threshold 40",
                       "engaged": ["taint", "tune", "drop_cache"],
                       "last": {"drop_cache": {"step": "engage", "result": "done",
                                              "detail": "2 pod(s), 512 B freed"}}},
        "evictions": [{"pod": "ns/p", "plugin": "system_pressure", "outcome": "evicted",
                       "reason": "free memory low", "ago_s": 2.5}],
        "taints": [{"key": "nri-qos.io/memory-pressure", "value": "", "effect": "NoSchedule",
                    "for_s": 61.2}],
    }
    out = io.StringIO()
    print_status(doc, out)
    text = out.getvalue()
    assert "\nmode              observe\n" in text
    assert "events" not in text  # not connected: no event list
    assert "runtime           none (not connected)" in text
    assert "reconciler        not running" in text
    assert ("  psi              node                     high     50 percent (threshold 40 percent)"
            in text)
    # Sizes for people, not 19658117120.0 bytes.
    assert ("  system_free      node                     none     18.3 GiB (threshold 2.0 GiB)"
            in text)
    assert ("mitigation ladder level medium (level medium: psi on node at 50 percent, "
            "threshold 40); taint, tune, drop_cache\n"
            "  drop_cache       last engage: done (2 pod(s), 512 B freed)\n") in text
    assert ("last evictions    \n  ns/p evicted (system_pressure: free memory low) 2.5 s ago\n"
            ) in text
    assert "taints            \n  nri-qos.io/memory-pressure=:NoSchedule for 61 s\n" in text
    doc.update(mitigation=None, evictions=None, taints=None)
    out = io.StringIO()
    print_status(doc, out)
    assert ("mitigation ladder not running\nlast evictions    not running\n"
            "taints            not running\n") in out.getvalue()


async def test_without_the_reconciler_its_features_say_so(tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "status.sock"
    config = tmp_path / "config.toml"
    # The state file where the test's agent keeps it: the default is the machine's agent's.
    config.write_text(f'[reconciler]\nenabled = false\nstate_dir = "{tmp_path / "state"}"\n'
                      f'[resctrl]\nenabled = false\n[status]\nsocket = "{sock}"\n')
    async with serving_daemon(config, RuntimeSimulator(tmp_path / "nri.sock")):
        doc = await document(sock)
    assert doc["reconciler"] == {"running": False, "waiting_for": None, "loops": {}}
    features = doc["features"]
    assert features["reconciler.drift"] == {"runs": False, "detail": "reconciler.enabled is false"}
    assert features["kubernetes"]["runs"] is False
    assert "the reconciler, which holds the API client, does not run" in \
        features["kubernetes"]["detail"]
    assert features["resctrl"] == {"runs": False, "detail": "resctrl.enabled is false"}


async def test_parts_switched_on_by_a_reload_wait_for_the_next_start_and_say_so(
        tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "status.sock"
    config = tmp_path / "config.toml"
    started = (f'[status]\nsocket = "{sock}"\n[agent]\nmode = "observe"\n'
               f'[reconciler]\nstate_dir = "{tmp_path / "state"}"\n')
    config.write_text(started + "enabled = false\n[resctrl]\nenabled = false\n")
    async with serving_daemon(config, RuntimeSimulator(tmp_path / "nri.sock")):
        config.write_text(started.replace("observe", "enforce"))
        os.kill(os.getpid(), signal.SIGHUP)
        async with asyncio.timeout(15):
            while True:
                doc = await document(sock)
                if doc["agent"]["mode"] == "enforce":
                    break
                await asyncio.sleep(0.05)
        _, text, _ = await status(sock, as_json=False)
    assert doc["agent"]["restart_needed"] == {
        "reconciler.enabled": {"in_force": False, "new": True},
        "resctrl.enabled": {"in_force": False, "new": True}}
    assert doc["reconciler"] == {"running": False, "waiting_for": None, "loops": {}}
    assert doc["features"]["resctrl"] == {"runs": False, "detail": "resctrl.enabled is false"}
    assert doc["features"]["reconciler.drift"] == {
        "runs": False, "detail": "reconciler.enabled is false"}
    assert ("restart needed    reconciler.enabled = true at the next start (false in force)\n"
            "restart needed    resctrl.enabled = true at the next start (false in force)\n"
            in text)


async def test_ladder_sections_show_what_the_ladder_and_the_eviction_manager_did(
    tmp_path: Path,
) -> None:
    with FakeApiServer() as fake:
        fake.add_node(NODE)
        env = make_env(tmp_path, fake)
        env.add_pod("batch1", fake=fake)
        forced(env, "batch1")
        assert await env.round() == [("batch/batch1", "evicted")]
        cfg = KubernetesConfig(kubeconfig=str(write_kubeconfig(tmp_path / "kc", fake.url)),
                               request_timeout_s=5.0)
        client = build_api_client(cfg)
        audit = AuditLog(MemoryAuditSink())
        taint = TaintAction(Config, KubeActions(client, cfg, audit), NODE, audit)
        board = Board()
        mitigation = Mitigation(Config, board, {"taint": taint}, audit, taints=taint.placed)
        sections = ladder_sections(mitigation, env.manager)
        stop = asyncio.Event()
        task = asyncio.create_task(mitigation.run(stop))
        try:
            board.publish("psi", [Reading("psi", NODE_SCOPE, Level.LOW, 20.0, 10.0, "percent",
                                          "some avg10")])
            await eventually(lambda: "engage" in mitigation.state().last.get("taint", ()), 10.0)
            ladder = sections["mitigation"]()
            # rungs of level low; only the taint rung has an action here
            assert (ladder["level"], ladder["engaged"]) == ("low", ["taint", "tune"])
            assert ladder["cause"] == (
                "level low: psi on node at 20 percent, threshold 10 percent (some avg10)")
            assert ladder["last"]["taint"]["step"] == "engage"
            assert ladder["last"]["taint"]["result"] == "done"
            (placed,) = sections["taints"]()
            assert (placed["key"], placed["effect"]) == ("nri-qos.io/memory-pressure",
                                                         "NoSchedule")
            assert 0 <= placed["for_s"] < 10
            (evicted,) = sections["evictions"]()
            assert evicted == {"pod": "batch/batch1", "plugin": "system_pressure",
                               "outcome": "evicted", "reason": "batch1 must go", "ago_s": 0.0}
            json.dumps(sections["mitigation"]())  # JSON-ready, as the socket sends it
        finally:
            stop.set()
            await asyncio.wait_for(task, 10.0)
            if client is not None:
                client.close()


class _ResetOnRecv(socket.socket):
    """A client socket whose peer resets the connection once it has connected."""

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        raise ConnectionResetError(104, "Connection reset by peer")


@contextlib.contextmanager
def _listening(path: Path, answer: bytes | None) -> Iterator[None]:
    """A status socket that answers one connection with ``answer`` (None: nothing) and closes
    it; the connection must come within the block."""
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen()

        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                if answer is not None:
                    conn.sendall(answer)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        yield
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_a_connection_reset_mid_answer_is_a_clear_error(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = short_dir / "status.sock"
    with _listening(path, None):
        monkeypatch.setattr(socket, "socket", _ResetOnRecv)
        assert main(["status", "--status-socket", str(path)]) == 1
    err = capsys.readouterr().err
    assert "broke before its answer was whole" in err
    assert "Connection reset by peer" in err
    assert "Traceback" not in err


def test_an_answer_nested_too_deeply_is_a_clear_error(
        short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = short_dir / "status.sock"
    with _listening(path, b"[" * 100_000 + b"]" * 100_000):
        assert main(["status", "--status-socket", str(path)]) == 1
    err = capsys.readouterr().err
    assert "is not a status document" in err
    assert "nested too deeply" in err


async def test_a_refused_configuration_is_shown_until_one_takes_effect(
        tmp_path: Path, short_dir: Path) -> None:
    """A refused version of the files is read once: the status keeps saying the node runs an
    older configuration than its files until a version takes effect."""
    sock = short_dir / "status.sock"
    config = tmp_path / "config.toml"
    good = (f'[status]\nsocket = "{sock}"\n[agent]\nmode = "observe"\n'
            f'[reconciler]\nstate_dir = "{tmp_path / "state"}"\n')
    config.write_text(good)

    async def reloaded(until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        os.kill(os.getpid(), signal.SIGHUP)
        async with asyncio.timeout(15):
            while True:
                doc = await document(sock)
                if until(doc):
                    return doc
                await asyncio.sleep(0.05)

    async with serving_daemon(config, RuntimeSimulator(tmp_path / "nri.sock")):
        assert (await document(sock))["agent"]["config_refused"] == []
        config.write_text(good + "[plugin]\nstrict = 1\n")
        doc = await reloaded(lambda d: bool(d["agent"]["config_refused"]))
        (error,) = doc["agent"]["config_refused"]
        assert str(config) in error
        assert "plugin.strict" in error
        _, text, _ = await status(sock, as_json=False)
        assert ("config refused    the files' latest version; the previous configuration "
                f"stays in force:\n  {error}\n") in text
        config.write_text(good.replace("observe", "enforce"))
        doc = await reloaded(lambda d: d["agent"]["mode"] == "enforce")
        assert doc["agent"]["config_refused"] == []
        _, text, _ = await status(sock, as_json=False)
        assert "config refused" not in text
