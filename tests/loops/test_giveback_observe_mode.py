"""A node switched from enforce to observe gets back the container values drift wrote (memcg
files, processes' oom_score_adj) where they still hold its last write, and drift writes nothing
new; switched back to enforce, drift writes the policy's values again. Values the runtime applied
at creation from the agent's answer (which observe mode gives too) stay."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.memory_qos import VOLCANO_ANNOTATION
from nri_plugin.config.schema import Config
from tests.support.builders import api_pod
from tests.support.drift_cycles import Drift
from tests.support.fakesys import GIB, MIB, FakeHost

UID = "aaaaaaaa-0000-0000-0000-00000000000a"
OOM = "qos.nri-qos.io/oom-score-adj"
KUBELETS = 300
HALF = str(256 * MIB)
FORTY = str(int(512 * MIB * 0.4) // 4096 * 4096)


def ratio(percent: int) -> str:
    return json.dumps({"memoryQos": {"highRatio": percent}})


class Node:
    """A v2 fake host with one burstable pod, the node state and a drift loop whose mode can be
    switched."""

    def __init__(self, tmp_path: Path) -> None:
        self.host = FakeHost(tmp_path, version=2, driver="systemd")
        self.host.set_numa([(8 * GIB, 16 * GIB, 100)])
        self.pod = self.host.add_pod(UID, tier="burstable", memory_limit=512 * MIB)
        self.c = self.pod.containers[0]
        self.pid = self.c.pids[0]
        self.set_score(KUBELETS)
        self.state = NodeState()
        pods, containers = self.host.nri()
        self.state.replace_all(pods, [dataclasses.replace(c, oom_score_adj=KUBELETS)
                                      for c in containers])
        self.sink = MemoryAuditSink()
        self.observe = False
        config = Config()
        self.drift = Drift(tmp_path, self.state, lambda: config, AuditLog(self.sink),
                           lambda: self.observe)

    def cycle(self) -> tuple[str, int]:
        """memory.high and the process's score after one cycle."""
        self.drift.cycle()
        return self.high(), self.score()

    def meta(self, annotations: dict[str, str]) -> None:
        self.state.apply_meta(api_pod(UID, self.pod.info.name, annotations,
                                      memory_limits={"c0": 512 * MIB}))

    def high_file(self) -> Path:
        return self.host.cg("memory", self.c.rel) / "memory.high"

    def high(self) -> str:
        return self.high_file().read_text().strip()

    def score(self) -> int:
        return int((self.host.root / "proc" / str(self.pid) / "oom_score_adj").read_text())

    def set_score(self, value: int) -> None:
        (self.host.root / "proc" / str(self.pid) / "oom_score_adj").write_text(f"{value}\n")

    def writes(self) -> int:
        return len(self.sink.named("cgroup_write"))


def test_switched_to_observe_drifts_values_go_back_and_enforce_writes_them_again(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.meta({VOLCANO_ANNOTATION: ratio(50), OOM: "500"})
    assert node.cycle() == (HALF, 500)
    node.observe = True
    assert node.cycle() == ("max", KUBELETS)
    written = node.writes()
    assert node.cycle() == ("max", KUBELETS)
    assert node.writes() == written  # nothing new: the policy's values are only audited
    assert {r["value"] for r in node.sink.named("write_observed")} == {HALF, "500"}
    node.observe = False
    assert node.cycle() == (HALF, 500)
    node.meta({})
    assert node.cycle() == ("max", KUBELETS)


def test_observe_leaves_what_someone_else_wrote_since(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.meta({VOLCANO_ANNOTATION: ratio(50), OOM: "500"})
    node.cycle()
    node.high_file().write_text(f"{300 * MIB}\n")
    node.set_score(700)
    node.observe = True
    assert node.cycle() == (str(300 * MIB), 700)


def test_values_applied_at_creation_stay_and_drifts_go_back_to_them(tmp_path: Path) -> None:
    node = Node(tmp_path)
    # The runtime applied the agent's answer at creation: drift finds the values there.
    node.high_file().write_text(f"{HALF}\n")
    node.set_score(500)
    node.meta({VOLCANO_ANNOTATION: ratio(50), OOM: "500"})
    assert node.cycle() == (HALF, 500)
    assert node.writes() == 0
    node.observe = True
    assert node.cycle() == (HALF, 500)
    assert node.writes() == 0
    node.observe = False
    node.meta({VOLCANO_ANNOTATION: ratio(40), OOM: "600"})  # changed through the API
    assert node.cycle() == (FORTY, 600)
    node.observe = True
    assert node.cycle() == (HALF, 500)
    node.meta({})  # while observing: held
    assert node.cycle() == (HALF, 500)
    node.observe = False
    assert node.cycle() == ("max", KUBELETS)
