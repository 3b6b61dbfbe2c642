"""Hostile annotation values over the real wire: no record grows with them, and every annotation
(and label) the agent reads holds against the corpus.

Every annotation the agent reads gets values no real pod carries: megabytes of text, deep
nesting, control characters, numbers that overflow, ``../`` in names, Unicode that folds into
ASCII, and values aimed at each reader's limits. Each must cost the pod only its own setting: the
answer it would get without the value, one audit record (bounded) from the reader, no file
created, never an exception on the wire.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from common.state import NodeState
from hooks.events import Event
from hooks.memory_qos import VOLCANO_ANNOTATION as VOLCANO_COLOCATION
from hooks.qos_level import KATALYST_ANNOTATION, KOORDINATOR_KEY, VOLCANO_ANNOTATION
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION
from nri_plugin.capabilities import build_capabilities
from nri_plugin.config.schema import Config
from nri_plugin.obs.logs import LoggingConfig, LoggingSetup
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.simulator import RuntimeSimulator
from protos import nri_api_pb2 as api
from tests.support.hostile_annotations import (
    LEVEL_KEYS,
    MAX_LINE,
    OOM_KEY,
    RESCTRL_KEY,
    Wire,
    corpus,
    tree_of,
)

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


async def test_no_record_grows_with_a_hostile_annotation(tmp_path: Path,
                                                          executor: ThreadPoolExecutor) -> None:
    stream = io.StringIO()
    logging_setup = LoggingSetup(LoggingConfig(format="json"), level="debug", stream=stream)
    cfg = Config()
    state = NodeState()
    capabilities = build_capabilities(cfg, resctrl=None, state=state, audit=logging_setup.audit,
                                      cgroup_v2=True, memory_total=64 << 30)
    simulator = RuntimeSimulator(tmp_path / "nri.sock")
    await simulator.start()
    stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: cfg,
                      capabilities=capabilities, audit=logging_setup.audit, executor=executor,
                      state=state, cgroup_v2=True)
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


@dataclass(frozen=True)
class Reader:
    """Who reads a key on the NRI path, and what it says about a value it cannot use."""

    # events (by the container named in the record: "" for the pod's) that record the problem
    containers: tuple[str, ...]
    reason: str


def reader(key: str, where: str) -> Reader | None:
    if where == "label" or key in LEVEL_KEYS:
        # The level is decided (and a value not understood recorded) at RunPodSandbox, for the
        # resctrl capability, and at CreateContainer.
        return Reader(("", "app"), f"{LEVEL_KEYS[key]}: unknown QoS value ")
    if key == VOLCANO_COLOCATION:
        return Reader(("app",), "memory_qos: ")
    if key in (RESCTRL_KEY, KOORDINATOR_ANNOTATION):
        return Reader(("",), "resctrl: ")
    if key == OOM_KEY:
        return Reader(("app",), "oom_score: ")
    return None  # read by the background loops only (see the reconciler tests below)


async def test_every_annotation_the_agent_reads_against_the_corpus(
        tmp_path: Path, executor: ThreadPoolExecutor) -> None:
    wire = Wire(tmp_path, executor)
    await wire.simulator.start()
    reader_, writer = await asyncio.open_unix_connection(str(tmp_path / "nri.sock"))
    played = 0
    try:
        async with asyncio.TaskGroup() as group:
            serving = group.create_task(wire.stub.serve(reader_, writer))
            connection = await wire.simulator.wait_ready()
            baseline = await wire.play(connection, {}, {})
            assert baseline.adjust.linux.oom_score_adj.value == 1000
            assert baseline.adjust.linux.rdt.clos_id.value == "nriqos-reclaimed_cores"
            before = tree_of(tmp_path / "host")
            seen = {key for _, key, _, _ in corpus()}
            assert seen == Config().read_keys().annotations | Config().read_keys().labels
            for where, key, name, value in corpus():
                wire.sink.records.clear()
                annotations = {key: value} if where == "annotation" else {}
                labels = {key: value} if where == "label" else {}
                answer = await wire.play(connection, annotations, labels)
                case = f"{where} {key} {name}"
                expected = baseline.adjust
                if key == VOLCANO_COLOCATION and not value.strip():
                    # An empty Volcano annotation resets memory.low and memory.min (documented
                    # Volcano semantics): zero protection, the level's memory.high kept.
                    expected = api.ContainerAdjustment()
                    expected.CopyFrom(baseline.adjust)
                    expected.linux.resources.unified.update({"memory.low": "0",
                                                             "memory.min": "0"})
                assert answer.adjust == expected, case
                # Never an escalation: no hook, the reclaimed floor, the class group.
                assert not answer.adjust.HasField("hooks"), case
                assert answer.adjust.linux.oom_score_adj.value == 1000, case
                assert answer.adjust.linux.rdt.clos_id.value == "nriqos-reclaimed_cores", case
                assert tree_of(tmp_path / "host") == before, case
                records = wire.sink.records
                assert all(len(json.dumps(f)) <= MAX_LINE for _, f in records), case
                skipped = [f for n, f in records if n == "adjustment_skipped"]
                others = [n for n, _ in records if n not in (
                    "adjustment_skipped", "adjustment_applied")]
                assert others == [], (case, others)
                read = reader(key, where)
                if read is None or (key == VOLCANO_COLOCATION and not value.strip()):
                    assert skipped == [], case
                else:
                    assert sorted(f["container"] for f in skipped) == sorted(read.containers), \
                        (case, skipped)
                    assert all(f["reason"].startswith(read.reason) for f in skipped), \
                        (case, skipped)
                played += 1
            assert connection.alive
            wire.stub.close()
            await serving
    finally:
        await wire.simulator.stop()
    assert played > 300
