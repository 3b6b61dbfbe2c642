"""The runtime simulator: scenarios, a full lifecycle, and its fidelity to the real runtime."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import nri_plugin.session.stub
from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.events import Event
from nri_plugin.cli.simulate import main_simulate, simulate
from nri_plugin.config.loader import ConfigError
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.scenario import RuntimeSpec, load_scenario
from nri_plugin.sim.simulator import RuntimeSimulator
from nri_plugin.wire.errors import CallTimedOut, ConnectionClosed, RpcError
from nri_plugin.wire.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from nri_plugin.wire.nri_api import PLUGIN_SERVICE, RUNTIME_SERVICE
from nri_plugin.wire.runtime_support import RuntimeSupport
from nri_plugin.wire.transport import TtrpcPeer
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as envelope
from tests.support.paths import REPO

NO_RESCTRL = "[resctrl]\nenabled = false\n"


async def run_scenario(tmp_path: Path, scenario_text: str | None,
                       cgroup: str | None = "v2") -> list[dict[str, object]]:
    """The answers, as for a cgroup v2 host unless ``cgroup`` says otherwise (None: this
    host's version)."""
    config = tmp_path / "config.toml"
    config.write_text(NO_RESCTRL)
    if scenario_text is None:
        scenario = load_scenario()
    else:
        path = tmp_path / "scenario.toml"
        path.write_text(scenario_text)
        scenario = load_scenario(path)
    out = io.StringIO()
    assert await simulate(scenario, str(config), "warning", as_json=True, cgroup=cgroup,
                          out=out) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


async def test_default_scenario_full_lifecycle(tmp_path: Path) -> None:
    answers = await run_scenario(tmp_path, None)
    creates = {a["container"]: a for a in answers if a["event"] == "create_container"}
    assert set(creates) == {"nginx", "etl"}
    offline = creates["etl"]["response"]
    assert offline["adjust"]["linux"]["oomScoreAdj"]["value"] == "1000"  # type: ignore[index]
    # Previewed for cgroup v2, the reclaimed default (memory.high = 95 % of the 2Gi limit,
    # page-aligned) shows.
    unified = offline["adjust"]["linux"]["resources"]["unified"]  # type: ignore[index]
    assert unified == {"memory.high": str((2 << 30) * 95 // 100 // 4096 * 4096)}
    assert "oomScoreAdj" not in json.dumps(creates["nginx"]["response"])
    assert {a["method"] for a in answers} >= {"RunPodSandbox", "CreateContainer",
                                              "RemoveContainer", "RemovePodSandbox"}


OLD_SCENARIO = """
[runtime]
version = "v1.7.20"
nri_version = ""
[[pods]]
id = "sb"
uid = "u1"
name = "batch-0"
namespace = "batch"
annotations = ["qos.nri-qos.io/level=reclaimed_cores"]
cgroup_parent = "/kubepods/besteffort/podu1"
existing = true
[[containers]]
id = "c1"
pod = "sb"
name = "work"
memory_limit = "256Mi"
[[steps]]
event = "run_pod_sandbox"
pod = "sb"
[[steps]]
event = "create_container"
container = "c1"
[[steps]]
event = "remove_container"
container = "c1"
"""


async def test_old_runtime_gets_state_change_and_legacy_mask(tmp_path: Path) -> None:
    answers = await run_scenario(tmp_path, OLD_SCENARIO)
    methods = [(a["event"], a["method"]) for a in answers]
    assert methods == [("run_pod_sandbox", "StateChange"), ("create_container", "CreateContainer"),
                       ("remove_container", "StateChange")]
    # containerd before 1.7.26 does not apply oom_score_adj: the answer leaves it out (the
    # reconciler applies it once the container runs).
    assert "oomScoreAdj" not in json.dumps(answers[1]["response"])


async def test_containerd_1_7_26_and_later_get_oom_score_adj(tmp_path: Path) -> None:
    answers = await run_scenario(tmp_path, OLD_SCENARIO.replace('"v1.7.20"', '"v1.7.27"'))
    assert answers[1]["event"] == "create_container"
    assert json.loads(json.dumps(answers[1]["response"]))["adjust"]["linux"][
        "oomScoreAdj"]["value"] == "1000"


@pytest.mark.parametrize(("runtime", "oom_in_answer"), [
    ("containerd/v1.7.27", True), ("containerd/v1.7.20", False)])
def test_simulate_previews_a_runtime(tmp_path: Path, runtime: str, oom_in_answer: bool) -> None:
    config = tmp_path / "config.toml"
    config.write_text(NO_RESCTRL)
    done = subprocess.run(
        [sys.executable, "-m", "nri_plugin", "simulate", "--runtime", runtime, "--config",
         str(config), "--log-level", "error"],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    header = [line for line in done.stdout.splitlines() if line.startswith("#")]
    assert header[0].startswith(f"# simulated runtime: containerd {runtime.split('/')[1]}")
    etl = next(line for line in done.stdout.splitlines()
               if line.startswith("create_container") and " etl " in line)
    assert ("oomScoreAdj" in etl) is oom_in_answer
    reconciler = next(line for line in header if "reconciler applies" in line)
    assert ("oom_score_adj" in reconciler) is not oom_in_answer


def test_simulate_rejects_a_malformed_runtime(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "nri_plugin", "simulate", "--runtime", "x"],
                          capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 2
    assert "NAME/VERSION" in done.stderr


def test_scenario_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[[pods]]\nid = "a"\ncolour = "red"\nlabels = ["novalue"]\n'
                    '[[containers]]\nid = "c"\npod = "b"\n'
                    '[[steps]]\nevent = "explode"\n')
    with pytest.raises(ConfigError) as error:
        load_scenario(path)
    text = str(error.value)
    assert "pods[0].colour: unknown key" in text
    assert "pods[0].labels" in text
    assert "containers[0].pod: no pod with id 'b'" in text
    assert "steps[0].event: must be one of" in text


def test_main_simulate_rejects_bad_scenario(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[runtime]\nrequest_timeout_ms = -1\n")
    assert main_simulate(str(path), None, None) == 2
    assert "runtime.request_timeout_ms" in capsys.readouterr().err


def greedy_mask(followed: object, capabilities: object, support: RuntimeSupport) -> int:
    """A plugin subscribing to an event containerd 1.7.27 does not know."""
    return 0x7FF | Event.UPDATE_POD_SANDBOX.bit


async def test_runtime_rejects_unknown_mask_bits_like_containerd(
    tmp_path: Path, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nri_plugin.session.stub, "subscription_mask", greedy_mask)
    simulator = RuntimeSimulator(tmp_path / "nri.sock", RuntimeSpec(version="1.7.27",
                                                                    nri_version=""))
    await simulator.start()
    stub = PluginStub(identity=PluginIdentity("greedy", "20"), config=Config, capabilities=[],
                      audit=AuditLog(MemoryAuditSink()), executor=executor,
                      state=NodeState())
    reader, writer = await asyncio.open_unix_connection(simulator.socket_path)
    serving = asyncio.create_task(stub.serve(reader, writer))
    with pytest.raises(ConnectionClosed, match="invalid plugin events: 0x800"):
        await simulator.wait_ready()
    assert await serving
    await simulator.stop()


async def test_unimplemented_notification_falls_back_to_state_change(tmp_path: Path) -> None:
    """A plugin serving only the pre-0.12 methods still gets every event, as StateChange."""
    simulator = RuntimeSimulator(tmp_path / "nri.sock")
    await simulator.start()
    reader, writer = await asyncio.open_unix_connection(simulator.socket_path)
    changes: list[int] = []

    async def configure(request: envelope.Request) -> bytes:
        return api.ConfigureResponse(events=0x7FF).SerializeToString()

    async def synchronize(request: envelope.Request) -> bytes:
        return b""

    async def state_change(request: envelope.Request) -> bytes:
        changes.append(api.StateChangeEvent.FromString(request.payload).event)
        return b""

    old_plugin = TtrpcPeer(reader, writer, serve_conn=PLUGIN_SERVICE_CONN,
                           call_conn=RUNTIME_SERVICE_CONN, handlers={
                               (PLUGIN_SERVICE, "Configure"): configure,
                               (PLUGIN_SERVICE, "Synchronize"): synchronize,
                               (PLUGIN_SERVICE, "StateChange"): state_change,
                           })
    running = asyncio.create_task(old_plugin.run())
    register = api.RegisterPluginRequest(plugin_name="old", plugin_idx="30")
    await old_plugin.call(RUNTIME_SERVICE, "RegisterPlugin", register.SerializeToString(),
                          timeout_s=5)
    connection = await simulator.wait_ready()
    assert not connection.state_change_only
    pod = api.PodSandbox(id="sb", uid="u", name="p", namespace="ns")
    await simulator.send(connection, Event.RUN_POD_SANDBOX, pod)
    await simulator.send(connection, Event.STOP_POD_SANDBOX, pod)
    assert changes == [Event.RUN_POD_SANDBOX, Event.STOP_POD_SANDBOX]
    assert connection.state_change_only
    with pytest.raises(RpcError):  # CreateContainer has no fallback
        await simulator.send(connection, Event.CREATE_CONTAINER, pod, api.Container(id="c"))
    old_plugin.close()
    await running
    await simulator.stop()


async def test_runtime_drops_a_plugin_that_misses_the_request_timeout(tmp_path: Path) -> None:
    class Stuck(Capability):
        # Claims to only compute, then blocks the loop: exactly what the runtime punishes.
        name = "stuck"
        events = inline_events = frozenset({Event.RUN_POD_SANDBOX})

        def run_pod_sandbox(self, event: object) -> None:
            time.sleep(0.4)

    socket_path = tmp_path / "nri.sock"
    simulator = RuntimeSimulator(socket_path, RuntimeSpec(request_timeout_ms=200))
    await simulator.start()
    with ThreadPoolExecutor(1) as executor:
        stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=Config,
                          capabilities=[Stuck()], audit=AuditLog(MemoryAuditSink()),
                          executor=executor, state=NodeState())
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        serving = asyncio.create_task(stub.serve(reader, writer))
        connection = await simulator.wait_ready()
        pod = api.PodSandbox(id="sb", uid="u", name="p", namespace="ns")
        with pytest.raises(CallTimedOut):
            await simulator.send(connection, Event.RUN_POD_SANDBOX, pod)
        assert not connection.alive
        assert "no answer within" in connection.error
        await serving
    await simulator.stop()
