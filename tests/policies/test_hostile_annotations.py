"""Hostile annotation values, over the real wire and through the reconciler.

Every annotation (and label) the agent reads gets values no real pod carries: megabytes of
text, deep nesting, control characters, numbers that overflow, ``../`` in names, Unicode that
folds into ASCII, and values aimed at each reader's limits. Each must cost the pod only its own
setting: the answer it would get without the value, one audit record (bounded) from the reader,
no escalation (no hook, the oom floor, resctrl caps, no file created), never an exception on the
wire. Through the API server the same values reach the level, drift, detection and eviction,
with the same outcome.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import CONFIG_SOURCE_ANNOTATION, PodMeta
from common.state import NodeState, report_refusals
from hooks.events import Event
from hooks.memory_qos import VOLCANO_ANNOTATION as VOLCANO_COLOCATION
from hooks.model import PodInfo
from hooks.qos_level import KATALYST_ANNOTATION, KOORDINATOR_KEY, VOLCANO_ANNOTATION
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION
from hooks.resctrl_groups import plan_class_groups
from nri_plugin.capabilities import build_capabilities
from nri_plugin.config.schema import Config
from nri_plugin.obs.logs import LoggingConfig, LoggingSetup
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.simulator import PluginConnection, RuntimeSimulator
from protos import nri_api_pb2 as api
from reconciler.detection.publisher import Publisher
from reconciler.detection.service import DetectorsLoop
from reconciler.detection.signals import Board, Level
from reconciler.host.cgroups import layout_for
from reconciler.host.probe import probe_host
from reconciler.host.resctrlfs import ResctrlFs
from reconciler.host.sysfs import SysFs
from reconciler.loops.drift import DriftLoop
from tests.support.eviction_env import LEVEL, forced, make_env
from tests.support.fake_apiserver import FakeApiServer
from tests.support.fakesys import FakeHost
from tests.support.qos_claims import SPELLINGS

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


# --- the corpus: every annotation (and label) the agent reads, over the wire ---------------------
#
# Each pod carries one hostile value under one key, on a besteffort pod (level reclaimed_cores,
# the most restricted, from its cgroup parent): whatever the value, the answers must be those of
# the same pod without it (the value is read, found wanting and left out), the reader must say
# so in exactly one audit record on the event that reads it, nothing may be created in the
# resctrl tree or anywhere else, and the connection stays up.

ANY = [
    ("empty", ""),
    ("spaces", "  \t "),
    ("invalid_json", "{not json"),
    ("truncated_json", '{"memoryQos": {"highRatio": 5'),
    ("deep_arrays", "[" * 100_000 + "]" * 100_000),
    ("deep_objects", '{"a":' * 2_000 + "1" + "}" * 2_000),
    ("mib_string", "A" * (1 << 20)),
    ("mib_json", json.dumps({"memoryQos": {"highRatio": 50}, "LLC": {}, "pad": "x" * (1 << 20)})),
    ("negative", "-1"),
    ("huge_negative", "-99999999999999999999999"),
    ("digits_5000", "9" * 5000),
    ("nan", "NaN"),
    ("infinity", "-Infinity"),
    ("dot_dot", "../../../../sys/fs/cgroup"),
    ("slash", "/"),
    ("nul", "\x00"),
    ("control", "\x1b[31m\r\nsystem_cores"),
    ("unicode", "\u202e\U0001f4a5" * 1000),
    ("json_array", "[1, 2]"),
    ("json_string", '"system_cores"'),
    ("json_number", "42"),
    ("json_null", "null"),
    ("json_true", "true"),
]

SYSTEM_SPELLINGS = [
    ("upper", "SYSTEM_CORES"),
    ("nul_suffix", "system_cores\x00"),
    ("long_s", "\u017fystem_cores"),
    ("zero_width", "system_cores\u200b"),
    ("no_break_space", "\u00a0system_cores"),
    ("fullwidth", "\uff53ystem_cores"),
    ("dot_dot_name", "../system_cores"),
]
CODE_SPELLINGS = [
    ("long_s", "\u017fY\u017fTEM"),
    ("long_s_ls", "L\u017f"),
    ("zero_width", "SYSTEM\u200b"),
    ("fullwidth", "\uff33\uff39\uff33\uff34\uff25\uff2d"),
    ("no_break_space", "\u00a0LSE"),
    ("nul_suffix", "LSE\x00"),
]
OOM = [
    ("below_floor", "-1000"),
    ("just_below_floor", "999"),
    ("minus_zero", "-0"),
    ("leading_plus_zero", "+0999"),
    ("exponent", "1e3"),
    ("hex", "0x3e8"),
    ("arabic_digits", "\u0661\u0660\u0660\u0660"),
    ("decimal", "1000.0"),
    ("nul_suffix", "1000\x00"),
    ("six_digits", "100000"),
]
COLOCATION = [
    ("lift_high", '{"memoryQos": {"highRatio": 100}}'),
    ("min_above_cap", '{"memoryQos": {"minRatio": 100}}'),
    ("low_above_cap", '{"memoryQos": {"lowRatio": 50}}'),
    ("high_over_100", '{"memoryQos": {"highRatio": 101}}'),
    ("high_negative", '{"memoryQos": {"highRatio": -5}}'),
    ("high_float", '{"memoryQos": {"highRatio": 50.0}}'),
    ("high_bool", '{"memoryQos": {"highRatio": true}}'),
    ("high_nan", '{"memoryQos": {"highRatio": NaN}}'),
    ("high_overflow", '{"memoryQos": {"highRatio": 1e400}}'),
    ("high_digits", '{"memoryQos": {"highRatio": ' + "9" * 5000 + "}}"),
    ("qos_string", '{"memoryQos": "all"}'),
    ("dot_dot_key", '{"memoryQos": {"../highRatio": 1}}'),
    ("unicode_key", '{"memoryQos": {"highRat\u0131o": 1}}'),
]
RESCTRL = [
    ("over_level_share", '{"LLC": {"schemata": {"range": [0, 100]}}}'),
    ("reversed_range", '{"LLC": {"schemata": {"range": [30, 10]}}}'),
    ("string_range", '{"LLC": {"schemata": {"range": ["0", "10"]}}}'),
    ("zero_percent", '{"LLC": {"schemata": {"percent": 0}}}'),
    ("nan_percent", '{"MB": {"schemata": {"percent": NaN}}}'),
    ("negative_cache", '{"LLC": {"schemataPerCache": [{"cacheID": -1, "range": [0, 10]}]}}'),
    ("absent_cache", '{"LLC": {"schemataPerCache": [{"cacheID": 99, "range": [0, 10]}]}}'),
    ("many_caches", json.dumps({"LLC": {"schemataPerCache": [
        {"cacheID": i, "range": [0, 10]} for i in range(2, 80)]}})),
    ("duplicate_parts", '{"llc": {}, "LLC": {}}'),
    ("many_unknown_keys", json.dumps({f"k{i}": 1 for i in range(400)})),
    ("dot_dot_key", '{"../LLC": {"schemata": {"percent": 10}}}'),
]

LEVEL_KEYS = {"qos.nri-qos.io/level": "annotation", KATALYST_ANNOTATION: "katalyst",
              KOORDINATOR_KEY: "koordinator", VOLCANO_ANNOTATION: "volcano"}
OOM_KEY = "qos.nri-qos.io/oom-score-adj"
RESCTRL_KEY = "qos.nri-qos.io/resctrl"
RSS_KEY = "nri-qos.io/rss-overuse-factor"


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


def corpus() -> Iterator[tuple[str, str, str, str]]:
    """(where, key, name, value) for every key the agent reads."""
    keys = Config().read_keys()
    for key in sorted(keys.annotations):
        for name, value in ANY:
            yield "annotation", key, name, value
    for key in sorted(keys.labels):
        for name, value in [*ANY, *CODE_SPELLINGS]:
            yield "label", key, name, value
    for key in ("qos.nri-qos.io/level", KATALYST_ANNOTATION):
        for name, value in SYSTEM_SPELLINGS:
            yield "annotation", key, name, value
    for key in (KOORDINATOR_KEY, VOLCANO_ANNOTATION):
        for name, value in CODE_SPELLINGS:
            yield "annotation", key, name, value
    for name, value in OOM:
        yield "annotation", OOM_KEY, name, value
    for name, value in COLOCATION:
        yield "annotation", VOLCANO_COLOCATION, name, value
    for key in (RESCTRL_KEY, KOORDINATOR_ANNOTATION):
        for name, value in RESCTRL:
            yield "annotation", key, name, value


def tree_of(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.suffix != ".sock"}


class Wire:
    """The real stub behind the runtime simulator, with resctrl on a fake tree."""

    def __init__(self, tmp_path: Path, executor: ThreadPoolExecutor) -> None:
        self.host = FakeHost(tmp_path / "host", version=2, driver="cgroupfs")
        self.resctrl_root = self.host.make_resctrl()
        self.cfg = Config()
        self.sink = MemoryAuditSink()
        audit = AuditLog(self.sink)
        sysfs = SysFs(self.host.root, audit)
        fs = ResctrlFs.detect(sysfs, "/sys/fs/resctrl", prefix=self.cfg.resctrl.group_prefix,
                              audit=audit, amd_mb_max=2048, warn=lambda _: None)
        assert fs is not None
        fs.apply_class_groups(plan_class_groups(self.cfg.resctrl, fs.info, fs.our_groups()),
                              reason="config", warn=lambda _: None)
        self.state = NodeState(qos=lambda: self.cfg.qos,
                               on_refused=report_refusals(audit, None))
        self.simulator = RuntimeSimulator(tmp_path / "nri.sock")
        self.stub = PluginStub(
            identity=PluginIdentity("nri-qos", "10"), config=lambda: self.cfg,
            capabilities=build_capabilities(self.cfg, resctrl=fs, audit=audit, cgroup_v2=True,
                                            memory_total=64 << 30),
            audit=audit, executor=executor, state=self.state, cgroup_v2=True)
        self.n = 0

    async def play(self, connection: PluginConnection, annotations: dict[str, str],
                   labels: dict[str, str], uid: str | None = None) -> api.CreateContainerResponse:
        """RunPodSandbox, CreateContainer, RemovePodSandbox of a fresh besteffort pod."""
        self.n += 1
        uid = uid if uid is not None else f"0000{self.n:04d}-aaaa-4bbb-8ccc-dddddddddddd"
        pod = api.PodSandbox(id=f"sb-{self.n}", uid=uid, name=f"p{self.n}", namespace="hostile",
                             annotations=annotations, labels=labels)
        pod.linux.cgroup_parent = f"/kubepods/besteffort/pod{self.n}"
        container = api.Container(id=f"c-{self.n}", pod_sandbox_id=pod.id, name="app")
        container.linux.resources.memory.limit.value = 1 << 30
        await self.simulator.send(connection, Event.RUN_POD_SANDBOX, pod)
        answer = await self.simulator.send(connection, Event.CREATE_CONTAINER, pod, container)
        assert isinstance(answer, api.CreateContainerResponse)
        await self.simulator.send(connection, Event.REMOVE_POD_SANDBOX, pod)
        return answer


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


# Claims of a level above what a besteffort pod has, in every spelling and place the agent reads.
ESCALATIONS = [(kind, key, value, level) for level, spellings in SPELLINGS.items()
               if level != "reclaimed_cores" for kind, key, value in spellings]


async def test_a_besteffort_pod_cannot_claim_a_higher_level_on_the_wire(
        tmp_path: Path, executor: ThreadPoolExecutor) -> None:
    """Through the runtime's copy: the answer of the same pod without the claim (the oom floor,
    the memory.high cap, the reclaimed class), one qos_level_refused record per claim."""
    wire = Wire(tmp_path, executor)
    await wire.simulator.start()
    reader_, writer = await asyncio.open_unix_connection(str(tmp_path / "nri.sock"))
    try:
        async with asyncio.TaskGroup() as group:
            serving = group.create_task(wire.stub.serve(reader_, writer))
            connection = await wire.simulator.wait_ready()
            baseline = await wire.play(connection, {}, {})
            assert baseline.adjust.linux.oom_score_adj.value == 1000
            assert "memory.high" in baseline.adjust.linux.resources.unified
            for kind, key, value, level in ESCALATIONS:
                wire.sink.records.clear()
                written = {key: value}
                answer = await wire.play(connection, written if kind == "annotation" else {},
                                         written if kind == "label" else {})
                case = (kind, key, value)
                assert answer.adjust == baseline.adjust, case
                refused = wire.sink.named("qos_level_refused")
                assert [(r["claim"], r["source"]) for r in refused] == \
                    [(level, f"{kind} {key}")], case
                assert refused[0]["pod"].startswith("hostile/"), case
            assert connection.alive
            wire.stub.close()
            await serving
    finally:
        await wire.simulator.stop()


def test_a_besteffort_pod_cannot_claim_a_higher_level_through_the_api() -> None:
    """Through the API server's copy (kubectl annotate on a running pod): the level stays the
    class's, and each claim is reported once."""
    reports: list[str] = []
    pod = PodInfo(id="sb", uid=RECONCILER_UID, name="p", namespace="hostile",
                  cgroup_parent=f"/kubepods/besteffort/pod{RECONCILER_UID}")
    for kind, key, value, level in ESCALATIONS:
        reports.clear()
        state = NodeState(on_refused=lambda pod, refusal: reports.append(refusal.claim))
        state.replace_all([pod], [])
        assert state.snapshot().pods["sb"].level == "reclaimed_cores"
        written = {key: value}
        state.apply_meta(api_meta(written if kind == "annotation" else {},
                                  written if kind == "label" else None))
        view = state.snapshot().pods["sb"]
        assert view.level == "reclaimed_cores", (kind, key, value)
        assert view.decision.refused is not None
        assert reports == [level], (kind, key, value)


@pytest.mark.parametrize("uid", ["../../../../etc", "/", "a/b", "..", "uid\x00x", "", "u" * 200,
                                 "\u0430bc-unicode"])
async def test_a_hostile_pod_uid_never_names_a_resctrl_group(
        tmp_path: Path, executor: ThreadPoolExecutor, uid: str) -> None:
    """The pod's own group is named from its uid: anything but a plain uid is refused (one
    record), and the pod stays in its level's class group."""
    wire = Wire(tmp_path, executor)
    await wire.simulator.start()
    reader_, writer = await asyncio.open_unix_connection(str(tmp_path / "nri.sock"))
    try:
        async with asyncio.TaskGroup() as group:
            serving = group.create_task(wire.stub.serve(reader_, writer))
            connection = await wire.simulator.wait_ready()
            before = tree_of(tmp_path)
            answer = await wire.play(connection, {RESCTRL_KEY: RESCTRL_ASK}, {}, uid=uid)
            assert answer.adjust.linux.rdt.clos_id.value == "nriqos-reclaimed_cores"
            assert tree_of(tmp_path) == before
            (skipped,) = [f for n, f in wire.sink.records if n == "adjustment_skipped"]
            assert skipped["reason"].startswith("resctrl: pod uid ")
            assert "is not a uid" in skipped["reason"]
            # A plain uid with the same annotation does get its group (the refusal is the uid's).
            created = await wire.play(connection, {RESCTRL_KEY: RESCTRL_ASK}, {})
            assert created.adjust.linux.rdt.clos_id.value.startswith("nriqos-pod-")
            wire.stub.close()
            await serving
    finally:
        await wire.simulator.stop()


RESCTRL_ASK = '{"LLC": {"schemata": {"range": [0, 20]}}}'


# --- the reconciler: the same values through the API server --------------------------------------
#
# With the pod watch on, the API server's copy of a pod's annotations overrides the runtime's
# (an annotation changed after creation reaches the policies), and some annotations are read only
# here: the RSS overuse factor (detection) and the static-pod marks (eviction).

RECONCILER_UID = "77777777-0000-4000-8000-000000000007"


def api_meta(annotations: dict[str, str], labels: dict[str, str] | None = None) -> PodMeta:
    meta = PodMeta(uid=RECONCILER_UID, namespace="hostile", name="p", annotations=annotations,
                   labels=labels or {}, priority=0,
                   memory_requests={"c0": 256 << 20}, memory_limits={"c0": 1 << 30})
    # What the pod watch keeps of a pod.
    return meta.trimmed(Config().read_keys())


def test_the_level_through_the_api_stays_the_default() -> None:
    state = NodeState()
    pod = PodInfo(id="sb", uid=RECONCILER_UID, name="p", namespace="hostile",
                  cgroup_parent=f"/kubepods/besteffort/pod{RECONCILER_UID}")
    state.replace_all([pod], [])
    cases = [(where, key, value) for where, key, _, value in corpus()
             if where == "label" or key in LEVEL_KEYS]
    assert len(cases) > 100
    for where, key, value in cases:
        values = {key: value}
        state.apply_meta(api_meta(values if where == "annotation" else {},
                                  values if where == "label" else None))
        view = state.snapshot().pods["sb"]
        assert view.level == "reclaimed_cores", (where, key, value[:40])
        assert view.decision.source == "kubernetes_qos"
        assert [source for source, _ in view.decision.rejected] == [LEVEL_KEYS[key]]


class Reconciled:
    """One besteffort pod on a fake cgroup v2 host, its level's drift repair and detection."""

    def __init__(self, root: Path) -> None:
        self.host = FakeHost(root, version=2, driver="cgroupfs")
        self.host.set_numa([(8 << 30, 16 << 30, 100)])
        pod = self.host.add_pod(RECONCILER_UID, tier="besteffort", memory_limit=1 << 30,
                                memory_request=256 << 20, name="p", namespace="hostile")
        (self.container,) = pod.containers
        self.pod = pod
        self.sink = MemoryAuditSink()
        self.audit = AuditLog(self.sink)
        self.sysfs = SysFs(root, self.audit)
        self.state = NodeState()
        self.state.replace_all(*self.host.nri())
        self.cfg = Config()
        self.drift = DriftLoop(lambda: self.cfg, self.state, self.sysfs, layout_for(self.sysfs),
                               16 << 30, audit=self.audit)

    def files(self) -> dict[str, str]:
        cg = self.host.cg("", self.container.rel)
        found = {name: (cg / name).read_text().strip()
                 for name in ("memory.high", "memory.low", "memory.min") if (cg / name).exists()}
        pid = self.container.pids[0]
        found["oom_score_adj"] = (self.host.root / f"proc/{pid}/oom_score_adj").read_text().strip()
        return found

    def ignored(self) -> list[dict[str, Any]]:
        return self.sink.named("annotation_ignored")


def test_drift_keeps_the_level_and_records_each_problem_once(tmp_path: Path) -> None:
    r = Reconciled(tmp_path)
    r.drift.cycle(0.0)
    baseline = r.files()
    assert baseline["oom_score_adj"] == "1000"
    assert baseline["memory.high"] == str((1 << 30) * 95 // 100 // 4096 * 4096)
    cases = [(key, name, value) for where, key, name, value in corpus()
             if where == "annotation" and key in (VOLCANO_COLOCATION, OOM_KEY)]
    assert len(cases) > 60
    for n, (key, name, value) in enumerate(cases):
        r.sink.records.clear()
        r.state.apply_meta(api_meta({key: value}))
        r.drift.cycle(float(n))
        r.drift.cycle(float(n) + 0.5)  # the problem lasts: no second record
        case = f"{key} {name}"
        expected = dict(baseline)
        if key == VOLCANO_COLOCATION and not value.strip():
            expected |= {"memory.low": "0", "memory.min": "0"}  # Volcano's reset
        assert r.files() == expected, case
        ignored = r.ignored()
        if key == VOLCANO_COLOCATION and not value.strip():
            assert ignored == [], case
            continue
        assert len(ignored) == 1, (case, ignored)
        (record,) = ignored
        assert (record["annotation"], record["container"]) == (key, "c0"), case
        assert record["reason"].endswith("; the reclaimed_cores policy's values apply"), case
        assert len(json.dumps(record)) <= MAX_LINE, case
        # Back to no annotation: nothing to say, and the same problem later is news again.
        r.state.apply_meta(api_meta({}))
        r.drift.cycle(float(n) + 0.7)
    assert [n for n, _ in r.sink.records if n not in ("cgroup_write", "annotation_ignored")] == []


def test_a_problem_the_creation_answer_recorded_is_not_recorded_again(tmp_path: Path) -> None:
    """The runtime's copy already carried the value: the CreateContainer answer recorded it, and
    the API's identical copy is not news to the reconciler."""
    r = Reconciled(tmp_path)
    pod = dataclasses.replace(r.pod.info, annotations={OOM_KEY: "-1000"})
    r.state.replace_all([pod], [c.info for c in r.pod.containers])
    r.state.apply_meta(api_meta({OOM_KEY: "-1000"}))
    r.drift.cycle(0.0)
    assert r.files()["oom_score_adj"] == "1000"
    assert r.ignored() == []
    r.state.apply_meta(api_meta({OOM_KEY: "-998"}))
    r.drift.cycle(1.0)
    (record,) = r.ignored()
    assert "-998 is outside [1000, 1000]" in record["reason"]


def test_the_rss_factor_annotation_against_the_corpus(tmp_path: Path) -> None:
    r = Reconciled(tmp_path)
    (r.host.cg("memory", r.host.pod_rel("besteffort", RECONCILER_UID)) / "memory.stat"
     ).write_text(f"anon {300 << 20}\nfile 0\n")
    cfg = dataclasses.replace(r.cfg, detection=dataclasses.replace(r.cfg.detection,
                                                                    entry_samples=1))
    board = Board()
    loop = DetectorsLoop(lambda: cfg, Publisher(board, r.audit, lambda: cfg.detection), r.state,
                         r.sysfs, probe_host(r.sysfs), audit=r.audit)
    values = [*ANY, ("long_s", "1.\u017f"), ("underscore", "0_9"), ("tiny", "1e-300"),
              ("below_minimum", "0.05"), ("looser", "2"), ("arabic", "\u0660.\u0669")]
    for n, (name, value) in enumerate(values):
        r.sink.records.clear()
        r.state.apply_meta(api_meta({RSS_KEY: value}))
        loop.cycle(2.0 * n)
        loop.cycle(2.0 * n + 1)
        (reading,) = [x for x in board.current() if x.detector == "rss_overuse"]
        # 300 MiB of anon against 256 MiB x 1.05: the node's factor decides (high at 268.8).
        assert reading.level is Level.HIGH, name
        assert reading.threshold == (256 << 20) * 1.05, name
        ignored = [f for n_, f in r.sink.records if n_ == "annotation_ignored"]
        assert len(ignored) == 1, (name, ignored)
        assert ignored[0]["annotation"] == RSS_KEY
        assert len(json.dumps(ignored[0])) <= MAX_LINE
    # A valid, stricter factor is used, and says nothing.
    r.sink.records.clear()
    r.state.apply_meta(api_meta({RSS_KEY: "1.01"}))
    loop.cycle(100.0)
    (reading,) = [x for x in board.current() if x.detector == "rss_overuse"]
    assert reading.threshold == (256 << 20) * 1.01
    assert [f for n_, f in r.sink.records if n_ == "annotation_ignored"] == []


@pytest.mark.parametrize("value", ["file", "http", "FILE", "file\x00", " file", "../file",
                                   "A" * (1 << 20), ""])
async def test_a_pod_cannot_make_itself_static_through_the_api(
        tmp_path: Path, fake: FakeApiServer, value: str) -> None:
    """kubelet stamps kubernetes.io/config.source on its own copy (the runtime's): the API's
    copy is the pod author's, and a pod writing "file" there must stay evictable."""
    env = make_env(tmp_path, fake)
    env.add_pod("claims", fake=fake,
                annotations={LEVEL: "reclaimed_cores", CONFIG_SOURCE_ANNOTATION: value})
    forced(env, "claims")
    assert await env.round() == [("batch/claims", "evicted")]
    assert env.sink.named("eviction_filtered") == []


async def test_a_static_pod_stays_static(tmp_path: Path, fake: FakeApiServer) -> None:
    """What kubelet stamped on the runtime's copy counts, whatever the API's copy says."""
    env = make_env(tmp_path, fake)
    env.add_pod("etcd", fake=fake, nri_annotations={CONFIG_SOURCE_ANNOTATION: "file"},
                annotations={LEVEL: "reclaimed_cores", CONFIG_SOURCE_ANNOTATION: "api"})
    env.add_pod("mirror", fake=fake,
                annotations={LEVEL: "reclaimed_cores", "kubernetes.io/config.mirror": "h"})
    forced(env, "etcd", "mirror")
    assert await env.round() == []
    assert env.audited("eviction_filtered", "why") == ["static or mirror pod"] * 2
