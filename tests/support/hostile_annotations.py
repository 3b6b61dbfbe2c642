"""Hostile values and the corpus shared by the hostile annotation tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState, report_refusals
from hooks.events import Event
from hooks.memory_qos import VOLCANO_ANNOTATION as VOLCANO_COLOCATION
from hooks.qos_level import KATALYST_ANNOTATION, KOORDINATOR_KEY, VOLCANO_ANNOTATION
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION
from hooks.resctrl_groups import plan_class_groups
from nri_plugin.capabilities import build_capabilities
from nri_plugin.config.schema import Config
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.sim.simulator import PluginConnection, RuntimeSimulator
from protos import nri_api_pb2 as api
from reconciler.host.resctrlfs import ResctrlFs
from reconciler.host.sysfs import SysFs
from tests.support.fakesys import FakeHost

MAX_LINE = 4096


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
            capabilities=build_capabilities(self.cfg, resctrl=fs, state=self.state, audit=audit,
                                            cgroup_v2=True, memory_total=64 << 30),
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
