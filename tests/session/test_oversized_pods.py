"""A pod whose annotations and labels would take it over what the node state keeps of one pod:
the event handler keeps it, as if it carried none of them, so it runs at the level its QoS class
gives it, with that level's settings, and one audit record says why."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState, report_refusals
from hooks.events import Event
from hooks.memory_qos import VOLCANO_ANNOTATION as VOLCANO_COLOCATION
from hooks.model import RuntimeInfo
from hooks.resctrl_groups import plan_class_groups
from nri_plugin.capabilities import build_capabilities
from nri_plugin.config.schema import Config
from nri_plugin.session.event_handler import EventHandler
from nri_plugin.session.terms import SessionTerms
from nri_plugin.wire.convert import MAX_POD_BYTES
from nri_plugin.wire.runtime_support import RuntimeSupport
from protos import nri_api_pb2 as api
from reconciler.host.resctrlfs import ResctrlFs
from reconciler.host.sysfs import SysFs
from tests.support.fakesys import FakeHost

CONTAINERD = SessionTerms(
    support=RuntimeSupport.detect("v0.12.0", "containerd", "v2.1.0"),
    runtime=RuntimeInfo(name="containerd", version="v2.1.0", nri_version=(0, 12, 0)),
    request_timeout_ms=2000,
)
RSS_FACTOR = "nri-qos.io/rss-overuse-factor"


class Node:
    """The event handler with every default capability, resctrl on a fake tree, cgroup v2."""

    def __init__(self, root: Path, executor: ThreadPoolExecutor) -> None:
        host = FakeHost(root, version=2, driver="cgroupfs")
        host.make_resctrl()
        self.cfg = Config()
        self.sink = MemoryAuditSink()
        audit = AuditLog(self.sink)
        fs = ResctrlFs.detect(SysFs(host.root, audit), "/sys/fs/resctrl",
                              prefix=self.cfg.resctrl.group_prefix, audit=audit,
                              amd_mb_max=2048, warn=lambda _: None)
        assert fs is not None
        fs.apply_class_groups(plan_class_groups(self.cfg.resctrl, fs.info, fs.our_groups()),
                              reason="config", warn=lambda _: None)
        self.state = NodeState(qos=lambda: self.cfg.qos, on_refused=report_refusals(audit, None))
        self.handler = EventHandler(
            config=lambda: self.cfg, audit=audit, executor=executor, state=self.state,
            capabilities=build_capabilities(self.cfg, resctrl=fs, state=self.state, audit=audit,
                                            cgroup_v2=True, memory_total=64 << 30))

    async def create(self, pod: api.PodSandbox) -> api.ContainerAdjustment:
        """RunPodSandbox and CreateContainer of the pod's one container: the answer's adjustment."""
        container = api.Container(id=f"c-{pod.uid}", pod_sandbox_id=pod.id, name="app")
        container.linux.resources.memory.limit.value = 1 << 30
        await self.answer(Event.RUN_POD_SANDBOX, pod, None)
        answer = await self.answer(Event.CREATE_CONTAINER, pod, container)
        return api.CreateContainerResponse.FromString(answer).adjust

    async def answer(self, event: Event, pod: api.PodSandbox,
                     container: api.Container | None) -> bytes:
        answer = self.handler.handle(event, pod, container, CONTAINERD)
        return answer if isinstance(answer, bytes) else await answer

    def ignored(self) -> list[dict[str, object]]:
        return [r for r in self.sink.named("adjustment_skipped")
                if str(r["reason"]).startswith("invalid input: annotations and labels ignored")]


def besteffort(uid: str, annotations: dict[str, str]) -> api.PodSandbox:
    pod = api.PodSandbox(id=f"sb-{uid}", uid=uid, name=f"p-{uid}", namespace="batch",
                         annotations=annotations)
    pod.linux.cgroup_parent = f"/kubepods/besteffort/pod{uid}"
    return pod


def assert_reclaimed(adjust: api.ContainerAdjustment) -> None:
    """The settings of reclaimed_cores: its class group, the memory.high cap, the oom floor."""
    rdt = adjust.linux.rdt.clos_id.value or adjust.linux.resources.rdt_class.value
    assert rdt == "nriqos-reclaimed_cores"
    assert "memory.high" in adjust.linux.resources.unified
    assert adjust.linux.oom_score_adj.value == 1000


async def test_a_besteffort_pod_keeps_its_level_whatever_size_its_annotations_are(
        tmp_path: Path, executor: ThreadPoolExecutor) -> None:
    node = Node(tmp_path, executor)
    baseline = await node.create(besteffort("plain", {}))
    assert_reclaimed(baseline)
    # Under the per-annotation cut (6,200 characters) and over the pod's bytes (4 per emoji).
    pod = besteffort("emoji", {VOLCANO_COLOCATION: "\U0001f600" * 6200})
    # Measured as read back: handing a string to protobuf caches its UTF-8 in it, and grows it.
    size = sum(map(sys.getsizeof, (pod.id, pod.uid, pod.name, pod.namespace,
                                   pod.linux.cgroup_parent, "", VOLCANO_COLOCATION,
                                   pod.annotations[VOLCANO_COLOCATION])))
    assert size > MAX_POD_BYTES
    adjust = await node.create(pod)
    assert adjust == baseline
    view = node.state.snapshot().pods["sb-emoji"]
    assert (view.level, view.decision.source) == ("reclaimed_cores", "kubernetes_qos")
    assert view.info.annotations == {}
    assert view.info.cgroup_parent == "/kubepods/besteffort/podemoji"
    (record,) = node.ignored()
    assert record["pod_uid"] == "emoji"
    assert record["reason"] == (
        f"invalid input: annotations and labels ignored ({VOLCANO_COLOCATION}): with its "
        f"annotations and labels the pod would take {size} bytes, more "
        f"than {MAX_POD_BYTES}: it is treated as if it carried none")


def pod_of_size(uid: str, size: int) -> api.PodSandbox:
    """A besteffort pod whose kept strings take exactly ``size`` bytes: the colocation config
    (unusable, so the level's settings either way) and the RSS factor, read by the loops only."""
    pod = besteffort(uid, {VOLCANO_COLOCATION: "x" * 16000})
    fixed = sum(map(sys.getsizeof, (
        pod.id, pod.uid, pod.name, pod.namespace, pod.linux.cgroup_parent, "",
        VOLCANO_COLOCATION, pod.annotations[VOLCANO_COLOCATION], RSS_FACTOR, "")))
    pod.annotations[RSS_FACTOR] = "1" * (size - fixed)
    return pod


@pytest.mark.parametrize("extra", [0, 1])
async def test_the_pod_byte_limit_at_its_exact_value(
        tmp_path: Path, executor: ThreadPoolExecutor, extra: int) -> None:
    node = Node(tmp_path, executor)
    baseline = await node.create(besteffort("plain", {}))
    assert {VOLCANO_COLOCATION, RSS_FACTOR} <= node.cfg.read_keys().annotations
    adjust = await node.create(pod_of_size("edge", MAX_POD_BYTES + extra))
    assert adjust == baseline
    kept = node.state.snapshot().pods["sb-edge"].info.annotations
    assert set(kept) == (set() if extra else {VOLCANO_COLOCATION, RSS_FACTOR})
    assert len(node.ignored()) == extra
