"""The generated protobuf modules exact against real traffic.

The recordings are byte streams captured between containerd (1.7.27 and 2.4.0-beta) and a
reference plugin. They are cut into frames here by a small local reader that is itself checked
against the reference decoder shipped with the recordings, so the schema checks below do not
depend on the project's own framing code.
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TypeVar

import pytest
from google.protobuf import message_factory
from google.protobuf.message import Message

from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as ttrpc
from tests.support.paths import CAPTURES, load_reference_decoder

FULL_17 = "containerd-1.7.27-full-lifecycle.jsonl"
FULL_24 = "containerd-2.4-full-lifecycle.jsonl"
THREE_24 = "containerd-2.4-three-events.jsonl"
ALL_RECORDINGS = (FULL_17, FULL_24, THREE_24)

MSG_TYPE_REQUEST = 1
MSG_TYPE_RESPONSE = 2
MIB = 1024 * 1024

M = TypeVar("M", bound=Message)

needs_captures = pytest.mark.skipif(
    not CAPTURES.is_dir(), reason=f"containerd recordings not found at {CAPTURES}"
)


# ---------------------------------------------------------------------------
# Reading the recordings
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    direction: str  # "r2p" (runtime to plugin) or "p2r"
    conn: int  # mux connection id
    stream: int  # ttrpc stream id
    kind: int  # ttrpc message type
    flags: int
    data: bytes


def read_frames(path: Path) -> list[Frame]:
    """Undo the two framing layers: mux frames per direction, ttrpc frames per connection."""
    mux: defaultdict[str, bytearray] = defaultdict(bytearray)
    conns: defaultdict[tuple[str, int], bytearray] = defaultdict(bytearray)
    frames: list[Frame] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        direction = record["dir"]
        buf = mux[direction]
        buf += bytes.fromhex(record["hex"])
        while len(buf) >= 8:
            conn, length = struct.unpack_from(">II", buf)
            if len(buf) < 8 + length:
                break
            stream_buf = conns[(direction, conn)]
            stream_buf += buf[8 : 8 + length]
            del buf[: 8 + length]
            while len(stream_buf) >= 10:
                size, stream, kind, flags = struct.unpack_from(">IIBB", stream_buf)
                if len(stream_buf) < 10 + size:
                    break
                frames.append(
                    Frame(direction, conn, stream, kind, flags, bytes(stream_buf[10 : 10 + size]))
                )
                del stream_buf[: 10 + size]
    leftovers = [key for key, rest in (*mux.items(), *conns.items()) if rest]
    if leftovers:
        raise ValueError(f"{path.name}: incomplete frame at end of recording: {leftovers}")
    return frames


def unknown_field_bytes(msg: Message, wire: bytes) -> int:
    """How many bytes of ``wire`` (which parsed into ``msg``) our schema did not recognise."""
    known = type(msg)()
    known.CopyFrom(msg)
    known.DiscardUnknownFields()
    return len(wire) - known.ByteSize()


def parse_exact(cls: type[M], wire: bytes) -> M:
    """Parse, insist every byte is a known field, and check the message survives a round trip."""
    msg = cls.FromString(wire)
    unknown = unknown_field_bytes(msg, wire)
    assert unknown == 0, f"{cls.__name__}: {unknown} bytes of unknown fields"
    assert cls.FromString(msg.SerializeToString()) == msg
    return msg


@dataclass(frozen=True)
class Call:
    conn: int
    stream: int
    method: str
    request: Message
    response: Message | None  # None when the recording holds no reply


@cache
def recorded_calls(name: str) -> tuple[Call, ...]:
    """Every ttrpc call in a recording, decoded with the method types named by our services."""
    pending: dict[tuple[int, int], tuple[str, type[Message], Message]] = {}
    calls: list[Call] = []
    for frame in read_frames(CAPTURES / name):
        if frame.kind == MSG_TYPE_REQUEST:
            envelope = parse_exact(ttrpc.Request, frame.data)
            method = api.DESCRIPTOR.pool.FindServiceByName(envelope.service).FindMethodByName(
                envelope.method
            )
            request = parse_exact(
                message_factory.GetMessageClass(method.input_type), envelope.payload
            )
            pending[(frame.conn, frame.stream)] = (
                envelope.method,
                message_factory.GetMessageClass(method.output_type),
                request,
            )
        elif frame.kind == MSG_TYPE_RESPONSE:
            reply = parse_exact(ttrpc.Response, frame.data)
            assert reply.status.code == 0, reply.status.message
            method_name, response_type, request = pending.pop((frame.conn, frame.stream))
            response = parse_exact(response_type, reply.payload)
            calls.append(Call(frame.conn, frame.stream, method_name, request, response))
    calls += [
        Call(conn, stream, method, request, None)
        for (conn, stream), (method, _, request) in pending.items()
    ]
    return tuple(calls)


def requests_of(name: str, method: str, cls: type[M]) -> list[M]:
    found = [call.request for call in recorded_calls(name) if call.method == method]
    assert all(isinstance(msg, cls) for msg in found)
    return [msg for msg in found if isinstance(msg, cls)]


def only_call(name: str, method: str) -> Call:
    matches = [call for call in recorded_calls(name) if call.method == method]
    assert len(matches) == 1, f"{name}: expected one {method}, found {len(matches)}"
    return matches[0]


# ---------------------------------------------------------------------------
# Decoding the recordings
# ---------------------------------------------------------------------------


@needs_captures
@pytest.mark.parametrize("name", ALL_RECORDINGS)
def test_frame_reader_agrees_with_reference_decoder(name: str) -> None:
    reference = load_reference_decoder()
    expected = [
        (direction, conn, stream, kind, flags, data)
        for _, direction, conn, stream, kind, flags, data in reference.messages(CAPTURES / name)
    ]
    ours = [
        (f.direction, f.conn, f.stream, f.kind, f.flags, f.data)
        for f in read_frames(CAPTURES / name)
    ]
    assert ours == expected
    assert len(ours) >= 12


@needs_captures
@pytest.mark.parametrize("name", ALL_RECORDINGS)
def test_recorded_successes_leave_status_out(name: str) -> None:
    # Both Go peers answer success without a status field, so absent status must mean OK.
    replies = [
        ttrpc.Response.FromString(f.data)
        for f in read_frames(CAPTURES / name)
        if f.kind == MSG_TYPE_RESPONSE
    ]
    assert replies
    assert not any(reply.HasField("status") for reply in replies)


def test_frame_reader_rejects_truncated_recording(tmp_path: Path) -> None:
    # mux header for conn 1 announcing 12 bytes, then a 10-byte ttrpc header promising 5 more
    partial = struct.pack(">II", 1, 12) + struct.pack(">IIBB", 5, 1, 1, 0) + b"\x0a\x00"
    path = tmp_path / "cut.jsonl"
    path.write_text(json.dumps({"t": 0.0, "dir": "r2p", "hex": partial.hex()}) + "\n")
    with pytest.raises(ValueError, match="incomplete frame"):
        read_frames(path)


def test_unknown_field_check_catches_extra_fields() -> None:
    wire = api.OptionalInt(value=5).SerializeToString() + b"\xf8\x06\x01"  # field 111 = 1
    msg = api.OptionalInt.FromString(wire)
    assert unknown_field_bytes(msg, wire) == 3
    with pytest.raises(AssertionError, match="unknown fields"):
        parse_exact(api.OptionalInt, wire)


@needs_captures
@pytest.mark.parametrize(
    ("name", "expected_methods"),
    [
        (
            FULL_17,
            {
                "RegisterPlugin",
                "Configure",
                "Synchronize",
                "CreateContainer",
                "UpdateContainer",
                "StopContainer",
                "StateChange",
            },
        ),
        (
            FULL_24,
            {
                "RegisterPlugin",
                "Configure",
                "Synchronize",
                "RunPodSandbox",
                "CreateContainer",
                "PostCreateContainer",
                "StartContainer",
                "PostStartContainer",
                "UpdateContainer",
                "PostUpdateContainer",
                "StopContainer",
                "RemoveContainer",
                "StopPodSandbox",
                "RemovePodSandbox",
            },
        ),
        (
            THREE_24,
            {
                "RegisterPlugin",
                "Configure",
                "Synchronize",
                "RunPodSandbox",
                "CreateContainer",
                "RemovePodSandbox",
            },
        ),
    ],
)
def test_every_recorded_call_decodes_exactly(name: str, expected_methods: set[str]) -> None:
    calls = recorded_calls(name)  # parse_exact inside asserts: no unknown bytes, round trip
    assert {call.method for call in calls} == expected_methods
    assert all(call.response is not None for call in calls), "every request was answered"
    assert {call.conn for call in calls if call.method == "RegisterPlugin"} == {2}
    assert {call.conn for call in calls if call.method != "RegisterPlugin"} == {1}


# ---------------------------------------------------------------------------
# Facts the recordings must yield
# ---------------------------------------------------------------------------


def assert_offline_pod(pod: api.PodSandbox, namespace: str, name: str, uid: str) -> None:
    assert (pod.namespace, pod.name, pod.uid) == (namespace, name, uid)
    assert pod.annotations["qos.lab/class"] == "offline"
    assert pod.linux.cgroup_parent == f"/kubepods/besteffort/pod{uid}"


@needs_captures
@pytest.mark.parametrize("name", [FULL_17, FULL_24])
def test_create_container_carries_pod_and_resources(name: str) -> None:
    (request,) = requests_of(name, "CreateContainer", api.CreateContainerRequest)
    assert_offline_pod(request.pod, "batch", "cap-pod", "cap-uid-1")
    assert "node.koordinator.sh/resctrl" in request.pod.annotations

    container = request.container
    assert container.name == "exec"
    assert container.pod_sandbox_id == request.pod.id
    assert "ROLE=offline" in container.env
    resources = container.linux.resources
    assert resources.memory.limit.value == 512 * MIB == 536870912
    assert resources.cpu.shares.value == 2
    assert resources.cpu.quota.value == 50000
    assert resources.cpu.period.value == 100000
    assert container.linux.cgroups_path.startswith("/kubepods/besteffort/podcap-uid-1/")


@needs_captures
def test_image_is_sent_by_containerd_2_4_only() -> None:
    (new,) = requests_of(FULL_24, "CreateContainer", api.CreateContainerRequest)
    assert new.container.image.name == "lab.local/busybox:1"
    assert new.container.image.digest.startswith("sha256:")
    assert new.container.image.config_digest.startswith("sha256:")
    (old,) = requests_of(FULL_17, "CreateContainer", api.CreateContainerRequest)
    assert not old.container.HasField("image")


@needs_captures
@pytest.mark.parametrize(
    ("name", "namespace", "pod_name", "uid"),
    [(FULL_24, "batch", "cap-pod", "cap-uid-1"), (THREE_24, "default", "lab-pod3", "lab-uid-3")],
)
def test_run_pod_sandbox_rpc(name: str, namespace: str, pod_name: str, uid: str) -> None:
    (request,) = requests_of(name, "RunPodSandbox", api.RunPodSandboxRequest)
    assert_offline_pod(request.pod, namespace, pod_name, uid)


@needs_captures
def test_containerd_1_7_sends_notifications_as_state_change() -> None:
    events = requests_of(FULL_17, "StateChange", api.StateChangeEvent)
    assert [api.Event.Name(e.event) for e in events] == [
        "RUN_POD_SANDBOX",
        "POST_CREATE_CONTAINER",
        "START_CONTAINER",
        "POST_START_CONTAINER",
        "POST_UPDATE_CONTAINER",
        "REMOVE_CONTAINER",
        "STOP_POD_SANDBOX",
        "REMOVE_POD_SANDBOX",
    ]
    for event in events:
        assert_offline_pod(event.pod, "batch", "cap-pod", "cap-uid-1")
    pod_events = {api.RUN_POD_SANDBOX, api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX}
    assert all(e.HasField("container") != (e.event in pod_events) for e in events)
    states = {api.Event.Name(e.event): e.container.state for e in events if e.HasField("container")}
    assert states["POST_START_CONTAINER"] == api.CONTAINER_RUNNING
    assert states["REMOVE_CONTAINER"] == api.CONTAINER_STOPPED


@needs_captures
def test_configure_from_containerd_1_7_has_no_nri_version() -> None:
    (request,) = requests_of(FULL_17, "Configure", api.ConfigureRequest)
    assert request.NRI_version == ""
    assert request.runtime_name == "containerd"
    assert request.runtime_version == "1.7.27+unknown"
    assert (request.registration_timeout, request.request_timeout) == (5000, 2000)
    assert request.config == ""


@needs_captures
@pytest.mark.parametrize("name", [FULL_24, THREE_24])
def test_configure_from_containerd_2_4_reports_nri_version(name: str) -> None:
    (request,) = requests_of(name, "Configure", api.ConfigureRequest)
    assert request.NRI_version == "v0.12.2"
    assert request.runtime_version == "2.4.0-beta+unknown"
    assert (request.registration_timeout, request.request_timeout) == (5000, 2000)


@needs_captures
@pytest.mark.parametrize(("name", "mask"), [(FULL_17, 0x7FF), (FULL_24, 0x7FF), (THREE_24, 0xD)])
def test_recorded_plugin_registration_and_subscription(name: str, mask: int) -> None:
    register = only_call(name, "RegisterPlugin").request
    assert isinstance(register, api.RegisterPluginRequest)
    assert len(register.plugin_idx) == 2
    assert register.plugin_idx.isdigit()
    assert register.NRI_version == "v0.12.2"
    answer = only_call(name, "Configure").response
    assert isinstance(answer, api.ConfigureResponse)
    assert answer.events == mask


@needs_captures
def test_synchronize_contents() -> None:
    (empty,) = requests_of(FULL_17, "Synchronize", api.SynchronizeRequest)
    assert (len(empty.pods), len(empty.containers), empty.more) == (0, 0, False)

    (sync,) = requests_of(FULL_24, "Synchronize", api.SynchronizeRequest)
    assert [(p.namespace, p.name, p.uid) for p in sync.pods] == [
        ("default", "lab-pod", "lab-uid-1"),
        ("default", "lab-pod2", "lab-uid-2"),
    ]
    assert [c.state for c in sync.containers] == [api.CONTAINER_RUNNING] * 2
    assert {c.pod_sandbox_id for c in sync.containers} == {p.id for p in sync.pods}
    assert not sync.more


@needs_captures
@pytest.mark.parametrize("name", ALL_RECORDINGS)
def test_recorded_create_container_answer(name: str) -> None:
    answer = only_call(name, "CreateContainer").response
    assert isinstance(answer, api.CreateContainerResponse)
    adjust = answer.adjust
    assert adjust.linux.oom_score_adj.value == 1000
    assert [(h.path, list(h.args)) for h in adjust.hooks.prestart] == [("/bin/true", ["true"])]
    assert dict(adjust.annotations) == {"qos.lab/applied": "go"}
    assert not answer.update
    assert not answer.evict


@needs_captures
def test_update_container_requests_new_memory_limit() -> None:
    for name in (FULL_17, FULL_24):
        (request,) = requests_of(name, "UpdateContainer", api.UpdateContainerRequest)
        assert request.linux_resources.memory.limit.value == 384 * MIB
        assert request.container.name == "exec"
