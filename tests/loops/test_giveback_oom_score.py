"""The oom_score_adj drift wrote to a container's processes goes back to kubelet's score once no
policy asks for one: an annotation removed through the API, a level moved and moved back, a
reload that turns the capability (or the reconciler) off; a process whose score someone else
changed since is left."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from tests.support.builders import api_pod
from tests.support.drift_cycles import Drift
from tests.support.fakesys import GIB, MIB, FakeContainer, FakeHost, FakePod

UID = "88888888-0000-0000-0000-000000000008"
OOM = "qos.nri-qos.io/oom-score-adj"
LEVEL = "qos.nri-qos.io/level"
KUBELETS = 300
"""kubelet's score of the burstable container (its spec's), which its processes start with."""


class Node:
    """A fake host with one burstable pod whose container kubelet gave ``kubelets``, the node
    state and a drift loop whose configuration can be swapped."""

    def __init__(self, tmp_path: Path, *, version: int = 2,
                 kubelets: int | None = KUBELETS) -> None:
        self.host = FakeHost(tmp_path, version=version,
                             driver="systemd" if version == 2 else "cgroupfs")
        self.host.set_numa([(8 * GIB, 16 * GIB, 100)])
        self.pod: FakePod = self.host.add_pod(UID, tier="burstable", memory_limit=512 * MIB)
        self.c: FakeContainer = self.pod.containers[0]
        for pid in self.c.pids:
            self.set_score(pid, KUBELETS)
        self.state = NodeState()
        pods, containers = self.host.nri()
        self.state.replace_all(pods, [dataclasses.replace(c, oom_score_adj=kubelets)
                                      for c in containers])
        self.sink = MemoryAuditSink()
        self.config = Config()
        self.drift = Drift(tmp_path, self.state, lambda: self.config, AuditLog(self.sink))
        self.loop = self.drift.loop

    def cycle(self) -> None:
        self.drift.cycle()

    def meta(self, annotations: dict[str, str]) -> None:
        self.state.apply_meta(api_pod(UID, self.pod.info.name, annotations,
                                      memory_limits={"c0": 512 * MIB}))

    def score(self, pid: int) -> int:
        return int((self.host.root / "proc" / str(pid) / "oom_score_adj").read_text())

    def scores(self) -> list[int]:
        return [self.score(pid) for pid in self.c.pids]

    def set_score(self, pid: int, value: int) -> None:
        (self.host.root / "proc" / str(pid) / "oom_score_adj").write_text(f"{value}\n")

    def oom_writes(self) -> list[str]:
        return [r["value"] for r in self.sink.named("cgroup_write")
                if r["path"].endswith("oom_score_adj")]


def test_the_score_of_an_annotation_goes_back_to_kubelets_when_it_is_removed(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.host.add_process(node.c, oom_score_adj=KUBELETS)
    node.meta({OOM: "500"})
    node.cycle()
    assert node.scores() == [500, 500]
    node.meta({})
    node.cycle()
    assert node.scores() == [KUBELETS, KUBELETS]
    node.cycle()
    assert node.oom_writes() == ["500", "500", str(KUBELETS), str(KUBELETS)]
    assert node.loop.noted_containers() == 0


def test_a_level_moved_through_the_api_and_back_gives_the_score_back(tmp_path: Path) -> None:
    for version in (2, 1):
        node = Node(tmp_path / f"v{version}", version=version)
        node.meta({LEVEL: "reclaimed_cores"})
        node.cycle()
        assert node.scores() == [1000]
        node.meta({})
        node.cycle()
        assert node.scores() == [KUBELETS]


def test_a_process_started_since_with_the_agents_score_gets_kubelets_too(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.meta({OOM: "500"})
    node.cycle()
    node.host.add_process(node.c, oom_score_adj=500)  # forked from one that holds 500
    node.meta({})
    node.cycle()
    assert node.scores() == [KUBELETS, KUBELETS]


def test_a_score_someone_else_wrote_since_is_left_alone(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.host.add_process(node.c, oom_score_adj=KUBELETS)
    node.meta({OOM: "500"})
    node.cycle()
    node.meta({})
    node.set_score(node.c.pids[1], 700)  # an operator's, after the agent
    node.cycle()
    assert node.scores() == [KUBELETS, 700]


def test_a_reload_turning_oom_or_the_reconciler_off_gives_the_score_back(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.meta({OOM: "500"})
    enforcing = Config()
    switched_off = [
        dataclasses.replace(enforcing, oom=dataclasses.replace(enforcing.oom, enabled=False)),
        dataclasses.replace(enforcing, reconciler=dataclasses.replace(
            enforcing.reconciler, enabled=False)),
        dataclasses.replace(enforcing, oom=dataclasses.replace(enforcing.oom, enabled=False),
                            memory=dataclasses.replace(enforcing.memory, enabled=False)),
    ]
    for config in switched_off:
        node.config = enforcing
        node.cycle()
        assert node.scores() == [500]
        node.config = config
        node.cycle()
        assert node.scores() == [KUBELETS]


def test_memory_qos_switched_off_leaves_the_score_the_policy_still_asks_for(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.config = dataclasses.replace(Config(), memory=dataclasses.replace(
        Config().memory, enabled=False))
    node.meta({OOM: "500"})
    node.cycle()
    node.cycle()
    node.cycle()
    assert node.scores() == [500]
    assert node.oom_writes() == ["500"]


def test_without_kubelets_score_the_agents_is_left_and_said(tmp_path: Path) -> None:
    node = Node(tmp_path, kubelets=None)
    node.meta({OOM: "500"})
    node.cycle()
    node.meta({})
    with capture_logs() as logs:
        node.cycle()
    assert node.scores() == [500]
    assert [e["path"] for e in logs if e["event"] == "container_value_left"] == [
        f"/proc/{node.c.pids[0]}/oom_score_adj"]
    assert node.loop.noted_containers() == 0
