"""Replay recorded containerd traffic to the real plugin stub and check what it writes back.

The runtime-to-plugin bytes of each recording are written to the plugin over a socketpair in the
recorded read-sized chunks. Every runtime message must decode, the capabilities must see the
recorded pod and container, and every byte the plugin writes must be a well-formed answer: one
response per request, same stream id, status OK, split into mux frames by the 4096-then-rest rule.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo
from hooks.settings import EMPTY_SETTINGS, ContainerSettings
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability, ContainerEvent, PodEvent
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.wire.envelope import decode_request, decode_response
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.ttrpc import MessageType
from protos import nri_api_pb2 as api
from tests.support.paths import CAPTURES, RECORDINGS
from tests.support.recordings import (
    check_split_rule,
    ends_on_a_message_boundary,
    recorded_reads,
    runtime_messages,
)

pytestmark = pytest.mark.skipif(not RECORDINGS, reason=f"no recordings in {CAPTURES}")


@dataclass(frozen=True)
class Expected:
    uid: str
    namespace: str
    name: str
    annotations: dict[str, str]
    cgroup_parent: str
    container: str
    memory_limit: int


CAP_POD = Expected("cap-uid-1", "batch", "cap-pod", {"qos.lab/class": "offline"},
                   "/kubepods/besteffort/podcap-uid-1", "exec", 512 << 20)
EXPECTED = {
    "containerd-2.4-full-lifecycle.jsonl": CAP_POD,
    "containerd-1.7.27-full-lifecycle.jsonl": CAP_POD,
    "containerd-2.4-three-events.jsonl": Expected(
        "lab-uid-3", "default", "lab-pod3", {"qos.lab/class": "offline"},
        "/kubepods/besteffort/podlab-uid-3", "work", 256 << 20),
}

REQUEST_TYPES = {"StateChange": api.StateChangeEvent, "Shutdown": api.Empty}


class Seen(Capability):
    """Subscribed to everything; remembers what the plugin handed it."""

    name = "seen"
    events = frozenset(Event)

    def __init__(self) -> None:
        self.pods: list[tuple[str, PodInfo]] = []
        self.containers: list[tuple[str, ContainerInfo]] = []
        self.synced_pods: list[PodInfo] = []

    def run_pod_sandbox(self, event: PodEvent) -> None:
        self.pods.append(("run_pod_sandbox", event.pod))

    def remove_pod_sandbox(self, event: PodEvent) -> None:
        self.pods.append(("remove_pod_sandbox", event.pod))

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        self.containers.append(("create_container", event.container))
        self.pods.append(("create_container", event.pod))
        return EMPTY_SETTINGS

    def observe(self, event: Event, pod: PodInfo, container: ContainerInfo | None) -> None:
        self.pods.append((event.name.lower(), pod))
        if container is not None:
            self.containers.append((event.name.lower(), container))

    def synchronize(self, pods: Sequence[PodInfo], containers: Sequence[ContainerInfo]) -> None:
        self.synced_pods.extend(pods)


@pytest.mark.parametrize("recording", RECORDINGS, ids=[p.name for p in RECORDINGS])
async def test_replay_recording(recording: Path) -> None:
    reads = recorded_reads(recording)
    messages = runtime_messages(reads)
    requests = {}
    for conn, stream_id, msg_type, data in messages:
        if conn == 1:
            assert msg_type == MessageType.REQUEST
            request = decode_request(data)
            assert request.service == "nri.pkg.api.v1alpha1.Plugin"
            message_type = REQUEST_TYPES.get(request.method) or getattr(
                api, f"{request.method}Request")
            message = message_type()
            message.ParseFromString(request.payload)  # every runtime message decodes
            requests[stream_id] = request.method
        else:
            assert (conn, msg_type) == (2, MessageType.RESPONSE)
            assert decode_response(data).ok

    capability = Seen()
    sink = MemoryAuditSink()
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    with ThreadPoolExecutor(max_workers=2) as executor:
        # The recorded pods carry a lab annotation; configured as the one the oom policy reads,
        # it is kept, while the runtime's own io.kubernetes.cri.* annotations are dropped.
        cfg = Config()
        cfg = dataclasses.replace(cfg, oom=dataclasses.replace(cfg.oom, annotation="qos.lab/class"))
        stub = PluginStub(identity=PluginIdentity("replay", "10"), config=lambda: cfg,
                          capabilities=[capability], audit=AuditLog(sink), executor=executor,
                          state=NodeState(), track_containers=True)
        serving = asyncio.create_task(stub.serve(reader, writer))
        loop = asyncio.get_running_loop()
        theirs.setblocking(False)
        written = bytearray()

        async def read_until(predicate: object) -> None:
            while not predicate():  # type: ignore[operator]
                chunk = await loop.sock_recv(theirs, 1 << 20)
                assert chunk, "plugin closed the connection"
                written.extend(chunk)

        def answers() -> list[tuple[int, int, int, int, bytes]]:
            return check_split_rule(bytes(written)) if ends_on_a_message_boundary(written) else []

        # The runtime answers RegisterPlugin, so it has to arrive first.
        await read_until(lambda: any(m[0] == 2 for m in answers()))
        for chunk in reads:
            await loop.sock_sendall(theirs, chunk)
        await read_until(lambda: sum(m[0] == 1 for m in answers()) == len(requests))
        theirs.close()
        await serving

    written_messages = check_split_rule(bytes(written))
    register = [m for m in written_messages if m[0] == 2]
    assert [(m[1], m[2]) for m in register] == [(1, MessageType.REQUEST)]
    assert decode_request(register[0][4]).method == "RegisterPlugin"
    responses = {}
    for conn, stream_id, msg_type, flags, data in written_messages:
        if conn != 1:
            continue
        assert (msg_type, flags) == (MessageType.RESPONSE, 0)
        reply = decode_response(data)
        assert reply.code == StatusCode.OK, reply.message
        responses[stream_id] = reply
    assert sorted(responses) == sorted(requests)
    configure = next(s for s, m in requests.items() if m == "Configure")
    events = api.ConfigureResponse.FromString(responses[configure].payload).events
    # Everything the recorded runtime knows, and nothing more (validation is never asked for).
    assert events == (0x7FF if "1.7" in recording.name else 0x1FFF)

    expected = EXPECTED[recording.name]
    created = [c for name, c in capability.containers if name == "create_container"]
    assert [(c.name, c.memory_limit) for c in created] == [
        (expected.container, expected.memory_limit)]
    pods = [p for _, p in capability.pods if p.uid == expected.uid]
    assert pods, "the recorded pod never reached the capabilities"
    for pod in pods:
        assert (pod.namespace, pod.name, pod.cgroup_parent) == (
            expected.namespace, expected.name, expected.cgroup_parent)
        assert expected.annotations.items() <= pod.annotations.items()
        assert not any(key.startswith("io.kubernetes.cri.") for key in pod.annotations)
    assert not sink.named("event_failed")
    assert not sink.named("adjustment_skipped")
