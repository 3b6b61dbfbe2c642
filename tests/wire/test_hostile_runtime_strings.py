"""A hostile runtime's strings, over a real socket: strings of megabytes where names belong never
reach a log line whole, and every refusal is logged once per kind and counted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nri_plugin.wire.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from nri_plugin.wire.runtime_support import LEGACY_VALID_EVENTS
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.ttrpc import MAX_DATA_LENGTH, MessageType, encode_frame
from protos import nri_api_pb2 as api
from tests.support.hostile_runtime import Start, daemon_connecting, named
from tests.support.raw_runtime import BOUND_S, configure_request, mux_frame, pod_message

LOG_LINE_LIMIT = 4096


# -- 5. strings of megabytes ----------------------------------------------------------------------


async def test_runtime_strings_never_reach_a_log_line_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    config_text = """
[plugin]
reconnect_initial_ms = 20
[resctrl]
enabled = false
[reconciler]
enabled = false
"""
    error = "E" * 100_000
    long_name = "n" * 1024  # as long as names may be: kept, but not logged whole
    async with daemon_connecting(tmp_path, config_text, "info") as connections:
        async with asyncio.timeout(BOUND_S):
            first = await connections.get()
        await first.register(error=error)
        assert await first.closed_within(BOUND_S)
        async with asyncio.timeout(BOUND_S):
            runtime = await connections.get()
        await runtime.register()
        huge = "r" * (MAX_DATA_LENGTH - 4096)
        assert (await runtime.call("Configure", configure_request(runtime_name=huge))).ok
        assert (await runtime.call("Synchronize", b"")).ok
        refused = pod_message("huge", name="p" * (MAX_DATA_LENGTH - 8192))
        kept = api.PodSandbox(id="sb-long", uid="u" * 256, name=long_name,
                              namespace=long_name,
                              annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
        container = api.Container(id="c-long", pod_sandbox_id="sb-long", name=long_name)
        for pod in (refused, kept):
            await runtime.call("RunPodSandbox",
                               api.RunPodSandboxRequest(pod=pod).SerializeToString())
            await runtime.call("CreateContainer", api.CreateContainerRequest(
                pod=pod, container=container).SerializeToString())
    lines = capsys.readouterr().err.splitlines()
    assert max(len(line.encode()) for line in lines) <= LOG_LINE_LIMIT
    # The runtime's 100 KB refusal is quoted (bounded) once, not once more as the reason.
    assert sum(error[:100] in line for line in lines) == 1
    events = [json.loads(line) for line in lines if '"nri_event"' in line]
    assert any(line.get("audit") for line in events), "the long-named pod was served"


async def test_versions_of_thousands_of_digits_are_unknown_not_a_failed_configure(
    session: Start,
) -> None:
    setup = await session()
    runtime = setup.runtime
    await runtime.register()
    configure = api.ConfigureRequest(runtime_name="containerd", runtime_version="2." + "9" * 5000,
                                     NRI_version="v0." + "1" * 5000, request_timeout=2000)
    reply = await runtime.call("Configure", configure.SerializeToString())
    assert reply.ok, reply.message
    # An unknown version: only the events every runtime accepts.
    events = api.ConfigureResponse.FromString(reply.payload).events
    assert events
    assert not events & ~LEGACY_VALID_EVENTS
    assert (await runtime.call("Synchronize", b"")).ok
    assert await runtime.create_container_ok()


# -- 6. refusals are loud, once ------------------------------------------------------------------


async def test_every_refusal_is_logged_once_per_kind_and_counted(
    session: Start, log_lines: Callable[[], list[dict[str, Any]]],
) -> None:
    setup = await session()
    runtime = setup.runtime
    await runtime.handshake()
    expected = {
        "bad_stream_id": StatusCode.INVALID_ARGUMENT,
        "unknown_service": StatusCode.UNIMPLEMENTED,
        "unknown_method": StatusCode.UNIMPLEMENTED,
        "bad_envelope": StatusCode.INVALID_ARGUMENT,
        "bad_payload": StatusCode.OK,  # fail-open: an empty answer
    }
    for _ in range(3):
        answers = {}
        runtime.write(runtime.request_bytes("CreateContainer", b"", 2))  # even
        answers["bad_stream_id"] = 2
        answers["unknown_service"] = runtime.send("CreateContainer", b"", service="no.Such")
        answers["unknown_method"] = runtime.send("NoSuchMethod", b"")
        bad = runtime.stream()
        runtime.write(mux_frame(PLUGIN_SERVICE_CONN, encode_frame(
            bad, MessageType.REQUEST, b"\xff\xff\xff")))
        answers["bad_envelope"] = bad
        answers["bad_payload"] = runtime.send("CreateContainer", b"\xff\xff garbage")
        runtime.write(mux_frame(9, b"for a connection nobody opened"))
        runtime.write(mux_frame(PLUGIN_SERVICE_CONN, encode_frame(runtime.stream(), 0x7E, b"?")))
        runtime.write(mux_frame(RUNTIME_SERVICE_CONN, encode_frame(
            99, MessageType.RESPONSE, b"")))
        for kind, stream_id in answers.items():
            assert (await runtime.answer(stream_id)).code == expected[kind], kind
    assert await runtime.create_container_ok()
    kinds = {*expected, "unknown_connection", "unknown_frame_type", "stray_response"}
    warnings = named(log_lines(), "nri_rejected")
    assert sorted(line["kind"] for line in warnings) == sorted(kinds)
    assert all(line["level"] == "warning" for line in warnings)
    assert setup.rejections() == dict.fromkeys(kinds, 3)
    setup.stub.close()
    await setup.ended()
    (summary,) = named(log_lines(), "nri_rejections")
    assert summary["counts"] == dict.fromkeys(kinds, 3)
