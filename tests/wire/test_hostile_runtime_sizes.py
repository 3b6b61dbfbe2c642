"""A hostile runtime's sizes, over a real socket: a Synchronize of many chunks or over its limits,
pods carrying megabytes, and frames over the size limit.

Memory is measured where it is the point (tracemalloc here, the RSS of an ``nri-qos run`` child
where the memory is the C library's)."""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from common.state import NodeState
from hooks.model import MAX_ANNOTATION_CHARS
from nri_plugin.config.schema import Config
from nri_plugin.wire.convert import MAX_POD_BYTES
from nri_plugin.wire.mux import PLUGIN_SERVICE_CONN
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.ttrpc import MAX_DATA_LENGTH, MessageType
from protos import nri_api_pb2 as api
from tests.support.hostile_runtime import Start
from tests.support.raw_runtime import (
    MiB,
    configure_request,
    container_message,
    mux_frame,
    plugin_config,
    pod_message,
    reset_peak,
    running_agent,
    status_kib,
)

READ_KEYS = sorted(Config().read_keys().annotations)


# -- 1. a Synchronize of many chunks --------------------------------------------------------------

AGENT_CONFIG = """
[plugin]
reconnect_initial_ms = 50
[reconciler]
enabled = false
[resctrl]
enabled = false
"""


async def test_split_synchronize_costs_one_chunk_of_memory_not_all_of_them(
    tmp_path: Path,
) -> None:
    # 16 chunks of 2.4 MiB: were the raw messages kept until the last chunk, the agent would
    # hold all 38 MiB of them (and convert them all at once, at the end).
    chunks, pods_per_chunk, blob = 16, 50, "b" * (48 << 10)
    async with running_agent(tmp_path, AGENT_CONFIG) as agent:
        runtime = await agent.accept()
        await runtime.register()
        assert (await runtime.call("Configure", configure_request())).ok
        before = status_kib(agent.pid, "VmRSS")
        reset_peak(agent.pid)
        for i in range(chunks):
            pods = [pod_message(f"s{i}-{j}", annotations={"unread/blob": blob})
                    for j in range(pods_per_chunk)]
            request = api.SynchronizeRequest(pods=pods, more=i < chunks - 1)
            reply = await runtime.call("Synchronize", request.SerializeToString())
            assert reply.ok
            assert api.SynchronizeResponse.FromString(reply.payload).more == (i < chunks - 1)
        growth_mib = (status_kib(agent.pid, "VmHWM") - before) / 1024
        assert await runtime.create_container_ok()
        runtime.close()
    assert growth_mib < 20, f"the agent grew by {growth_mib:.0f} MiB for a 38 MiB Synchronize"


@pytest.mark.parametrize(("limit", "listed", "refused"), [
    ("max_sync_pods", 5, False), ("max_sync_pods", 6, True),
    ("max_sync_containers", 5, False), ("max_sync_containers", 6, True),
])
async def test_synchronize_over_its_limits_is_refused_and_the_known_state_kept(
    session: Start, limit: str, listed: int, refused: bool,
) -> None:
    state = NodeState()
    first = await session(plugin_config(**{limit: 5}), state=state)
    known = [pod_message("known")]
    await first.runtime.register()
    await first.runtime.call("Configure", configure_request())
    await first.runtime.call("Synchronize", api.SynchronizeRequest(
        pods=known, containers=[container_message("known")]).SerializeToString())
    assert set(state.snapshot().pods) == {"sb-known"}

    # The runtime reconnects (it restarted) and lists more than the agent takes, in chunks.
    again = await session(plugin_config(**{limit: 5}), state=state)
    runtime = again.runtime
    await runtime.register()
    await runtime.call("Configure", configure_request())
    uids = [f"u{i}" for i in range(listed)]
    chunks = [uids[:3], uids[3:]]
    for i, chunk in enumerate(chunks):
        request = api.SynchronizeRequest(
            pods=[pod_message(uid) for uid in chunk],
            containers=[container_message(uid) for uid in chunk], more=i == 0)
        reply = await runtime.call("Synchronize", request.SerializeToString())
        # Answered as the runtime requires, refused or not: it would drop the plugin otherwise.
        assert reply.ok
        assert api.SynchronizeResponse.FromString(reply.payload).more == (i == 0)
    pods = set(state.snapshot().pods)
    failed = again.sink.named("event_failed")
    if refused:
        assert pods == {"sb-known"}
        (record,) = failed
        assert record["nri_event"] == "synchronize"
        assert f"{listed} " in record["reason"]
        assert f"plugin.{limit} = 5" in record["reason"]
        assert again.rejections() == {"synchronize_over_limit": 1}
    else:
        assert pods == {f"sb-{uid}" for uid in uids}
        assert failed == []
    # Either way the agent serves events, on what it knows.
    assert await runtime.create_container_ok("known")


@pytest.mark.parametrize("extra", [0, 1])
async def test_synchronize_byte_limit_at_its_exact_value(session: Start, extra: int) -> None:
    limit = 4 * MiB  # the smallest allowed; the chunks add up to it, or to one byte more
    last = api.SynchronizeRequest(pods=[pod_message("c")]).SerializeToString()

    def chunk(uid: str, padding: int) -> bytes:
        pod = pod_message(uid, annotations={"unread/pad": "p" * padding})
        return api.SynchronizeRequest(pods=[pod], more=True).SerializeToString()

    first = chunk("a", limit // 2)
    target = limit + extra - len(last) - len(first)
    padding = target - len(chunk("b", 0))
    while len(chunk("b", padding)) > target:
        padding -= 1
    second = chunk("b", padding)
    assert len(first) + len(second) + len(last) == limit + extra
    setup = await session(plugin_config(max_sync_bytes=limit))
    await setup.runtime.register()
    await setup.runtime.call("Configure", configure_request())
    for payload in (first, second, last):
        assert (await setup.runtime.call("Synchronize", payload)).ok
    assert set(setup.state.snapshot().pods) == (set() if extra else {"sb-a", "sb-b", "sb-c"})
    assert len(setup.sink.named("event_failed")) == extra


# -- 2. pods carrying megabytes -------------------------------------------------------------------


async def test_pods_keep_only_what_policies_read_and_give_it_back(
    session: Start, traced: Callable[[], int],
) -> None:
    setup = await session()
    runtime = setup.runtime
    await runtime.handshake()
    # 3 MiB of annotations per pod, as many labels as anyone would put on a pod.
    half = "x" * (3 * MiB // 2)
    eighth = "x" * (3 * MiB // len(READ_KEYS))
    many_labels = {f"label-{i}": "v" * 63 for i in range(128)}
    pods = [
        # One read annotation of 1.5 MiB (kept cut), as much unread, labels nothing reads.
        *(pod_message(f"fat{i}", annotations={READ_KEYS[0]: half, "unread/blob": half},
                      labels=many_labels) for i in range(10)),
        # Every annotation the agent reads, long: more than one pod may keep (kept without
        # any of them).
        *(pod_message(f"hostile{i}", annotations=dict.fromkeys(READ_KEYS, eighth))
          for i in range(10)),
    ]
    baseline = traced()
    for pod in pods:
        await runtime.call("RunPodSandbox", api.RunPodSandboxRequest(pod=pod).SerializeToString())
        await runtime.call("CreateContainer", api.CreateContainerRequest(
            pod=pod, container=container_message(pod.uid)).SerializeToString())
    views = setup.state.snapshot().pods
    assert set(views) == {f"sb-{pod.uid}" for pod in pods}
    assert all(views[f"sb-hostile{i}"].info.annotations == {} for i in range(10))
    # The snapshot holds the pods' strings, which must be gone once the pods are.
    del views
    kept = traced() - baseline
    # Each fat pod keeps its one read annotation, cut to the longest value a policy accepts
    # (plus one character), and its container; each hostile pod its ids and its container.
    assert kept < 10 * (MAX_ANNOTATION_CHARS + (8 << 10)) + 10 * (4 << 10), \
        f"{kept} bytes kept for 20 pods"
    for pod in pods:
        await runtime.call("RemovePodSandbox",
                           api.RemovePodSandboxRequest(pod=pod).SerializeToString())
    assert setup.state.snapshot().pods == {}
    left = traced() - baseline
    assert left < 64 << 10, f"{left} bytes still held after every pod went"


async def test_synchronized_pods_too_large_to_keep_whole_are_kept_without_annotations(
    session: Start,
) -> None:
    setup = await session()
    await setup.runtime.register()
    await setup.runtime.call("Configure", configure_request())
    # Every annotation the agent reads, together over what one pod may keep.
    hostile = dict.fromkeys(READ_KEYS, "x" * (MAX_POD_BYTES // len(READ_KEYS)))
    pods = [pod_message("h0", annotations=hostile), pod_message("plain"),
            pod_message("h1", annotations=hostile)]
    reply = await setup.runtime.call("Synchronize",
                                     api.SynchronizeRequest(pods=pods).SerializeToString())
    assert reply.ok
    views = setup.state.snapshot().pods
    assert set(views) == {"sb-h0", "sb-plain", "sb-h1"}
    assert [views[f"sb-{uid}"].level for uid in ("h0", "plain", "h1")] == ["reclaimed_cores"] * 3
    assert views["sb-h0"].info.annotations == views["sb-h1"].info.annotations == {}
    # One record for all of them, naming the first.
    (record,) = setup.sink.named("adjustment_skipped")
    assert record["pod_uid"] == "h0"
    assert record["reason"].startswith("invalid input: annotations and labels ignored (")
    assert record["reason"].endswith("; so were those of 1 more pods")
    assert setup.sink.named("event_failed") == []


# -- 7. frames over the size limit ---------------------------------------------------------------


async def test_an_oversized_frame_is_answered_and_the_connection_kept(
    session: Start, traced: Callable[[], int],
) -> None:
    setup = await session()
    runtime = setup.runtime
    await runtime.handshake()
    stream_id = runtime.stream()
    length = MAX_DATA_LENGTH + 1
    message = struct.pack(">IIBB", length, stream_id, MessageType.REQUEST, 0) + bytes(length)
    baseline = traced()
    tracemalloc.reset_peak()
    # As a Go runtime writes it: 4096 bytes, then the rest, here in 64 KiB writes.
    runtime.write(mux_frame(PLUGIN_SERVICE_CONN, message[:4096]))
    rest = memoryview(message)[4096:]
    runtime.write(struct.pack(">II", PLUGIN_SERVICE_CONN, len(rest)))
    for i in range(0, len(rest), 64 << 10):
        runtime.write(rest[i : i + (64 << 10)])
        await runtime.flush()
    reply = await runtime.answer(stream_id)
    peak = tracemalloc.get_traced_memory()[1] - baseline
    assert reply.code == StatusCode.RESOURCE_EXHAUSTED
    assert reply.message == f"message length {length} exceed maximum message size of 4194304"
    # Skipped as it arrived, never held whole.
    assert peak < 2 * MiB, f"peak of {peak} bytes for a {length}-byte frame"
    assert await runtime.create_container_ok()
    assert not setup.serving.done()
    assert setup.rejections() == {"oversized_frame": 1}
