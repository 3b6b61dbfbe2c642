"""Hostile annotation values cannot escalate a pod, over the wire and through the reconciler.

A besteffort pod cannot claim a higher level on the wire or through the API server, a hostile
pod UID never names a resctrl group, drift keeps the level and records each problem once, the
rss factor annotation holds against the corpus, and a pod cannot make itself static.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import CONFIG_SOURCE_ANNOTATION, PodMeta
from common.state import NodeState
from hooks.memory_qos import VOLCANO_ANNOTATION as VOLCANO_COLOCATION
from hooks.model import PodInfo
from nri_plugin.config.schema import Config
from reconciler.detection.publisher import Publisher
from reconciler.detection.service import DetectorsLoop
from reconciler.detection.signals import Board, Level
from reconciler.host.cgroups import layout_for
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.loops.drift import DriftLoop
from tests.support.eviction_env import LEVEL, forced, make_env
from tests.support.fake_apiserver import FakeApiServer
from tests.support.fakesys import FakeHost
from tests.support.hostile_annotations import (
    ANY,
    LEVEL_KEYS,
    MAX_LINE,
    OOM_KEY,
    RESCTRL_KEY,
    Wire,
    corpus,
    tree_of,
)
from tests.support.qos_claims import SPELLINGS

RSS_KEY = "nri-qos.io/rss-overuse-factor"


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
        # The request comes from the API: the cgroup's memory.min of 0 is a kubelet without
        # MemoryQoS, which tells the runtime no request.
        pod = self.host.add_pod(RECONCILER_UID, tier="besteffort", memory_limit=1 << 30,
                                name="p", namespace="hostile")
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
