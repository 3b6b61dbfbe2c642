"""Hostile annotation values through the real stub: bounded records, default behaviour.

Every annotation the agent reads gets values no real pod carries: megabytes of text, deep
nesting, control characters, keys of a hundred kilobytes. Each must cost the pod only its own
setting (an audit record and the level's default) and never produce a log or audit line longer
than a few kilobytes, on any event.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hooks.events import Event
from hooks.memory_qos import VOLCANO_ANNOTATION as VOLCANO_COLOCATION
from hooks.qos_level import KATALYST_ANNOTATION, KOORDINATOR_KEY, VOLCANO_ANNOTATION
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION
from nri_plugin.capabilities import build_capabilities
from nri_plugin.config.schema import Config
from nri_plugin.logs import LoggingConfig, LoggingSetup
from nri_plugin.simulator import RuntimeSimulator
from nri_plugin.stub import PluginIdentity, PluginStub
from protos import nri_api_pb2 as api
from reconciler.state import NodeState

MAX_LINE = 4096
BIG = "A" * 200_000


def hostile_values() -> Iterator[tuple[str, str]]:
    yield "huge", BIG
    yield "megabyte_json", json.dumps({"memoryQos": {"highRatio": 50}, "pad": "x" * (1 << 20)})
    yield "deep", "[" * 50_000 + "]" * 50_000
    yield "huge_key", json.dumps({"k" * 100_000: 1})
    yield "huge_nested_key", json.dumps({"memoryQos": {"k" * 100_000: 1},
                                         "LLC": {"q" * 100_000: 1}})
    # Within the size the policies accept, yet one key alone larger than a record may be.
    yield "long_key", json.dumps({"memoryQos": {"k" * 10_000: 1}})
    yield "long_resctrl_key", json.dumps({"L" * 3_000: 1, "MB": {"m" * 900: 1}})
    yield "long_level", "x" * 16_000
    yield "control", "\x00\x1b[31m\r\n" * 5_000
    yield "unicode", "\u202e\U0001f4a5" * 50_000
    yield "numbers", json.dumps({"memoryQos": {"highRatio": 10**400}})
    yield "negative", "-99999999999999999999999"


KEYS = ["qos.nri-qos.io/level", KATALYST_ANNOTATION, KOORDINATOR_KEY, VOLCANO_ANNOTATION,
        VOLCANO_COLOCATION, "qos.nri-qos.io/resctrl", KOORDINATOR_ANNOTATION,
        "qos.nri-qos.io/oom-score-adj"]


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield pool


async def test_no_record_grows_with_a_hostile_annotation(tmp_path: Path,
                                                          executor: ThreadPoolExecutor) -> None:
    stream = io.StringIO()
    logging_setup = LoggingSetup(LoggingConfig(format="json"), level="debug", stream=stream)
    cfg = Config()
    capabilities = build_capabilities(cfg, resctrl=None, audit=logging_setup.audit,
                                      cgroup_v2=True, memory_total=64 << 30)
    simulator = RuntimeSimulator(tmp_path / "nri.sock")
    await simulator.start()
    stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: cfg,
                      capabilities=capabilities, audit=logging_setup.audit, executor=executor,
                      state=NodeState(), cgroup_v2=True)
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "nri.sock"))
    try:
        async with asyncio.TaskGroup() as group:
            serving = group.create_task(stub.serve(reader, writer))
            connection = await simulator.wait_ready()
            n = 0
            for key in KEYS:
                for name, value in hostile_values():
                    n += 1
                    pod = api.PodSandbox(id=f"sb-{n}", uid=f"uid-{n}", name=f"{name}-{n}",
                                         namespace="hostile", annotations={key: value},
                                         labels={key: value[:63]})
                    pod.linux.cgroup_parent = f"/kubepods/besteffort/poduid-{n}"
                    container = api.Container(id=f"c-{n}", pod_sandbox_id=pod.id, name="app")
                    container.linux.resources.memory.limit.value = 1 << 30
                    await simulator.send(connection, Event.RUN_POD_SANDBOX, pod)
                    response = await simulator.send(connection, Event.CREATE_CONTAINER, pod,
                                                    container)
                    assert isinstance(response, api.CreateContainerResponse)
                    linux = response.adjust.linux
                    # Never an escalation: no hook, the reclaimed floor kept.
                    assert not response.adjust.HasField("hooks")
                    if linux.HasField("oom_score_adj"):
                        assert linux.oom_score_adj.value >= 2
                    await simulator.send(connection, Event.REMOVE_POD_SANDBOX, pod)
            assert connection.alive
            stub.close()
            await serving
    finally:
        await simulator.stop()
        logging_setup.close()
    await asyncio.sleep(0)  # the event lines are written on the next turn of the loop
    lines = stream.getvalue().splitlines()
    assert len(lines) > len(KEYS) * 9 * 3  # at least one line per event
    longest = max(lines, key=len)
    assert len(longest.encode()) <= MAX_LINE, longest[:300]
    audit = [json.loads(line) for line in lines if '"audit":true' in line.replace(" ", "")]
    skipped = [r for r in audit if r["event"] == "adjustment_skipped"]
    assert skipped, "hostile values are audited"
