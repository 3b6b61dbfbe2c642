"""The real capabilities behind the real stub: the runtime simulator over a unix socket, and a
replay of the recorded containerd traffic of ``batch/cap-pod``."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.events import Event
from hooks.memory_qos import VOLCANO_ANNOTATION
from hooks.resctrl_groups import plan_class_groups
from nri_plugin.capabilities import build_capabilities
from nri_plugin.config.loader import parse_toml
from nri_plugin.config.schema import Config
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.scenario import RuntimeSpec
from nri_plugin.sim.simulator import PluginConnection, RuntimeSimulator
from nri_plugin.wire.envelope import decode_request, decode_response
from nri_plugin.wire.status import StatusCode
from protos import nri_api_pb2 as api
from reconciler.host.resctrlfs import ResctrlFs
from reconciler.host.sysfs import SysFs
from tests.support.builders import hook_executable
from tests.support.paths import RECORDINGS
from tests.support.recordings import (
    check_split_rule,
    ends_on_a_message_boundary,
    recorded_reads,
    runtime_messages,
)
from tests.support.resctrl_trees import intel_tree

MI = 1 << 20
OLD_RUNTIME = RuntimeSpec(version="v1.7.27", nri_version="", request_timeout_ms=2000)


@pytest.fixture
def tool(tmp_path: Path) -> Path:
    (tmp_path / "bin").mkdir()
    return hook_executable(tmp_path / "bin" / "nri-qos-hook")


def node_config(root: Path, tool: Path, extra: str = "") -> Config:
    config: Config = parse_toml(Config, f"""
[resctrl]
root = "{root}"
[resctrl.monitor_hook]
enabled = true
path = "{tool}"
timeout_s = 2
[memory]
cgroup_version = "v2"
[[oci_hooks.levels.reclaimed_cores.prestart]]
path = "{tool}"
args = ["nri-qos-hook", "--version"]
timeout_s = 3
{extra}""")
    return config


@dataclass
class Plugin:
    config: Config
    fs: ResctrlFs
    sink: MemoryAuditSink
    audit: AuditLog

    def stub(self, executor: ThreadPoolExecutor) -> PluginStub:
        state = NodeState(qos=lambda: self.config.qos)
        capabilities = build_capabilities(self.config, resctrl=self.fs, state=state,
                                          audit=self.audit,
                                          cgroup_v2=self.config.memory.cgroup_version == "v2",
                                          memory_total=0)
        return PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: self.config,
                          capabilities=capabilities, audit=self.audit, executor=executor,
                          state=state)


def make_plugin(tmp_path: Path, tool: Path, extra: str = "") -> Plugin:
    root = intel_tree(tmp_path / "resctrl")
    config = node_config(root, tool, extra)
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    warnings: list[str] = []
    fs = ResctrlFs.detect(SysFs("/", audit), str(root), prefix=config.resctrl.group_prefix,
                          audit=audit, amd_mb_max=config.resctrl.amd_mb_max,
                          warn=warnings.append)
    assert fs is not None, warnings
    fs.apply_class_groups(plan_class_groups(config.resctrl, fs.info, fs.our_groups()),
                          reason="config", warn=warnings.append)
    assert warnings == []
    return Plugin(config, fs, sink, audit)


class Session:
    def __init__(self, simulator: RuntimeSimulator, conn: PluginConnection) -> None:
        self.simulator = simulator
        self.conn = conn

    async def create(self, pod_msg: api.PodSandbox, ctr: api.Container) -> dict[str, Any]:
        await self.simulator.send(self.conn, Event.RUN_POD_SANDBOX, pod_msg)
        response = await self.simulator.send(self.conn, Event.CREATE_CONTAINER, pod_msg, ctr)
        assert isinstance(response, api.CreateContainerResponse)
        return MessageToDict(response.adjust)


@pytest.fixture
async def session(tmp_path: Path, tool: Path,
                  executor: ThreadPoolExecutor) -> AsyncIterator[tuple[Session, Plugin]]:
    plugin = make_plugin(tmp_path, tool)
    simulator = RuntimeSimulator(tmp_path / "nri.sock", RuntimeSpec())
    await simulator.start()
    stub = plugin.stub(executor)
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "nri.sock"))
    serving = asyncio.create_task(stub.serve(reader, writer))
    conn = await simulator.wait_ready()
    try:
        yield Session(simulator, conn), plugin
    finally:
        stub.close()
        await serving
        await simulator.stop()


# What a pod must be to claim each level: its Kubernetes QoS class (the cgroup parent kubelet
# chose) and, for system_cores, a namespace the node lists for it.
CLAIMABLE = {"dedicated_cores": ("ns", "/kubepods/pod{uid}"),
             "system_cores": ("kube-system", "/kubepods/pod{uid}")}


def pod(uid: str, level: str | None = None, **annotations: str) -> api.PodSandbox:
    if level is not None:
        annotations["qos.nri-qos.io/level"] = level
    namespace, parent = CLAIMABLE.get(level or "", ("ns", "/kubepods/burstable/pod{uid}"))
    message = api.PodSandbox(id=f"sb-{uid}", uid=uid, name=f"pod-{uid}", namespace=namespace,
                             annotations=annotations)
    message.linux.cgroup_parent = parent.format(uid=uid)
    return message


def container(uid: str, limit: int = 512 * MI, request: int = 256 * MI) -> api.Container:
    message = api.Container(id=f"c-{uid}", pod_sandbox_id=f"sb-{uid}", name="app")
    message.linux.resources.memory.limit.value = limit
    message.linux.resources.unified["memory.min"] = str(request)
    return message


# The online levels' default memory.low is the request (256 MiB); system_cores sets none.
EXPECTED: dict[str, dict[str, Any]] = {
    "dedicated_cores": {"linux": {"resources": {"unified": {"memory.low": str(256 * MI)}},
                                  "rdt": {"closId": {"value": "nriqos-dedicated_cores"}}}},
    "shared_cores": {"linux": {"resources": {"unified": {"memory.low": str(256 * MI)}},
                               "rdt": {"closId": {"value": "nriqos-shared_cores"}}}},
    "system_cores": {"linux": {"rdt": {"closId": {"value": "nriqos-system_cores"}}}},
}


@pytest.mark.parametrize("level", sorted(EXPECTED))
async def test_online_levels_exact_adjustment(session: tuple[Session, Plugin], level: str) -> None:
    sess, plugin = session
    adjust = await sess.create(pod("u1", level), container("u1"))
    assert adjust == EXPECTED[level]
    assert not plugin.sink.named("adjustment_skipped")


async def test_reclaimed_level_exact_adjustment(session: tuple[Session, Plugin],
                                                tool: Path) -> None:
    sess, _ = session
    adjust = await sess.create(pod("u1", "reclaimed_cores"), container("u1"))
    assert adjust == {
        "hooks": {"prestart": [{"path": str(tool), "args": ["nri-qos-hook", "--version"],
                                "timeout": {"value": "3"}}]},
        "linux": {
            "resources": {"unified": {"memory.high": "510025728"}},
            "oomScoreAdj": {"value": "1000"},
            "rdt": {"closId": {"value": "nriqos-reclaimed_cores"}},
        },
    }


async def test_pod_group_lifecycle_through_the_runtime(session: tuple[Session, Plugin],
                                                       tool: Path) -> None:
    sess, plugin = session
    uid = "0c9f3b1e-7a2d-4c11-8e5f-2b6d4a8c1e90"
    group = f"nriqos-pod-{uid}"
    p = pod(uid, "shared_cores", **{"node.koordinator.sh/resctrl":
                                    '{"LLC":{"schemata":{"range":[20,80]}},'
                                    '"MB":{"schemata":{"percent":20}}}'})
    adjust = await sess.create(p, container(uid))
    assert adjust == {
        "hooks": {"prestart": [{"path": str(tool), "timeout": {"value": "2"}, "args": [
            "nri-qos-hook", "resctrl-join", "--root", plugin.fs.mount, "--group", group]}]},
        "linux": {"resources": {"unified": {"memory.low": str(256 * MI)}},
                  "rdt": {"closId": {"value": group}}},
    }
    schemata = (Path(plugin.fs.mount) / group / "schemata").read_text()
    assert schemata == "L3:0=1fc;1=1fc\nMB:0=20;1=20\n"
    await sess.simulator.send(sess.conn, Event.REMOVE_POD_SANDBOX, p)
    assert not (Path(plugin.fs.mount) / group).exists()
    assert [r["group"] for r in plugin.sink.named("resctrl_group_removed")] == [group]


async def test_pod_group_outlives_a_replaced_sandbox(session: tuple[Session, Plugin]) -> None:
    # kubelet recreates a pod's sandbox: RunPodSandbox of the new one (same pod uid), then
    # RemovePodSandbox of the old one. The group the new sandbox's containers joined stays.
    sess, plugin = session
    uid = "5d1e8f2a-3b4c-4d5e-8f60-718293a4b5c6"
    group = f"nriqos-pod-{uid}"
    annotations = {"node.koordinator.sh/resctrl": '{"MB":{"schemata":{"percent":20}}}'}
    old = pod(uid, "shared_cores", **annotations)
    new = pod(uid, "shared_cores", **annotations)
    new.id = f"sb-{uid}-2"
    replacement = container(uid)
    replacement.id, replacement.pod_sandbox_id = f"c-{uid}-2", new.id
    await sess.create(old, container(uid))
    adjust = await sess.create(new, replacement)
    assert adjust["linux"]["rdt"] == {"closId": {"value": group}}
    schemata = Path(plugin.fs.mount) / group / "schemata"
    await sess.simulator.send(sess.conn, Event.REMOVE_POD_SANDBOX, old)
    assert schemata.read_text() == "L3:0=7ff;1=7ff\nMB:0=20;1=20\n"
    assert plugin.sink.named("resctrl_group_removed") == []
    await sess.simulator.send(sess.conn, Event.REMOVE_POD_SANDBOX, new)
    assert not (Path(plugin.fs.mount) / group).exists()
    assert [(r["group"], r["reason"]) for r in plugin.sink.named("resctrl_group_removed")] == [
        (group, f"pod {uid} removed")]


async def test_invalid_annotations_fail_open(session: tuple[Session, Plugin]) -> None:
    sess, plugin = session
    p = pod("u9", "reclaimed_cores", **{
        "node.koordinator.sh/resctrl": "{broken",
        VOLCANO_ANNOTATION: '{"memoryQos":{"highRatio":400}}',
        "qos.nri-qos.io/oom-score-adj": "-1000",
    })
    adjust = await sess.create(p, container("u9"))
    linux = adjust["linux"]
    # Every invalid part is skipped; the level's own settings still apply.
    assert linux["rdt"] == {"closId": {"value": "nriqos-reclaimed_cores"}}
    assert linux["oomScoreAdj"] == {"value": "1000"}
    assert linux["resources"]["unified"] == {"memory.high": "510025728"}
    reasons = [r["reason"] for r in plugin.sink.named("adjustment_skipped")]
    assert any(r.startswith("resctrl: invalid JSON") for r in reasons)
    assert any(r.startswith("memory_qos: memoryQos.highRatio") for r in reasons)
    assert any(r.startswith("oom_score: ") for r in reasons)


async def test_old_runtime_gets_rdt_class(tmp_path: Path, tool: Path,
                                          executor: ThreadPoolExecutor) -> None:
    plugin = make_plugin(tmp_path, tool)
    simulator = RuntimeSimulator(tmp_path / "nri.sock", OLD_RUNTIME)
    await simulator.start()
    stub = plugin.stub(executor)
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "nri.sock"))
    serving = asyncio.create_task(stub.serve(reader, writer))
    try:
        sess = Session(simulator, await simulator.wait_ready())
        adjust = await sess.create(pod("u1", "shared_cores"), container("u1"))
        assert adjust == {"linux": {"resources": {
            "rdtClass": {"value": "nriqos-shared_cores"},
            "unified": {"memory.low": str(256 * MI)}}}}
    finally:
        stub.close()
        await serving
        await simulator.stop()


# --- replay of the recorded batch/cap-pod ----------------------------------------------------

CAP_RECORDINGS = [p for p in RECORDINGS if "full-lifecycle" in p.name]


@pytest.mark.skipif(not CAP_RECORDINGS, reason="no recordings")
@pytest.mark.parametrize("recording", CAP_RECORDINGS, ids=[p.name for p in CAP_RECORDINGS])
async def test_replay_cap_pod_as_reclaimed(tmp_path: Path, tool: Path, recording: Path) -> None:
    plugin = make_plugin(tmp_path, tool, extra="""
[qos]
sources = ["kubernetes_qos"]
[qos.kubernetes_qos]
besteffort = "reclaimed_cores"
""")
    reads = recorded_reads(recording)
    requests = {stream: decode_request(data).method
                for conn, stream, _, data in runtime_messages(reads) if conn == 1}
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    with ThreadPoolExecutor(max_workers=2) as executor:
        stub = plugin.stub(executor)
        serving = asyncio.create_task(stub.serve(reader, writer))
        loop = asyncio.get_running_loop()
        theirs.setblocking(False)
        written = bytearray()

        def answers() -> list[tuple[int, int, int, int, bytes]]:
            return check_split_rule(bytes(written)) if ends_on_a_message_boundary(written) else []

        async def read_until(count_conn: int, count: int) -> None:
            while sum(m[0] == count_conn for m in answers()) < count:
                chunk = await loop.sock_recv(theirs, 1 << 20)
                assert chunk, "plugin closed the connection"
                written.extend(chunk)

        await read_until(2, 1)
        # Like the runtime, wait for each answer before going on: RunPodSandbox has finished
        # (pod group and monitor group made) before CreateContainer arrives.
        for i, chunk in enumerate(reads):
            await loop.sock_sendall(theirs, chunk)
            sent = sum(conn == 1 for conn, *_ in runtime_messages(reads[:i + 1]))
            await read_until(1, sent)
        theirs.close()
        await serving

    responses = {stream: decode_response(data) for conn, stream, _, _, data in answers()
                 if conn == 1}
    create = next(s for s, m in requests.items() if m == "CreateContainer")
    assert responses[create].code == StatusCode.OK
    adjust = MessageToDict(api.CreateContainerResponse.FromString(
        responses[create].payload).adjust)
    group = "nriqos-pod-cap-uid-1"
    linux = adjust["linux"]
    assert linux["resources"]["unified"] == {"memory.high": "510025728"}   # 0.95 x 512 MiB
    rdt_field = ({"rdtClass": {"value": group}} if "1.7" in recording.name else None)
    if rdt_field is not None:
        assert linux["resources"]["rdtClass"] == {"value": group}
    else:
        assert linux["rdt"] == {"closId": {"value": group}}
    # Both recorded runtimes apply oom_score_adj: containerd 1.7.27 vendors NRI v0.8.0.
    assert linux["oomScoreAdj"] == {"value": "1000"}
    # The recorded Koordinator annotation (L3 20..80 %) exceeds reclaimed's 0..30 %: L3 stays
    # at the level's share, MB 20 % is honoured.
    assert "outside the allowed [0, 30]" in plugin.sink.named("adjustment_skipped")[0]["reason"]
    prestart = adjust["hooks"]["prestart"]
    assert prestart == [
        {"path": str(tool), "timeout": {"value": "2"}, "args": [
            "nri-qos-hook", "resctrl-join", "--root", plugin.fs.mount, "--group", group]},
        {"path": str(tool), "args": ["nri-qos-hook", "--version"], "timeout": {"value": "3"}},
    ]
    # RemovePodSandbox at the end of the recording removed the pod group.
    assert not (Path(plugin.fs.mount) / group).exists()
    created = [r["group"] for r in plugin.sink.named("resctrl_group_created")]
    assert group in created
