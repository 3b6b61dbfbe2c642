"""What drift keeps across a restart of the agent: its notes of the container files it set and
kubelet's values of each container, in the state file; and what it does before the runtime's
first list arrives (nothing: every container would look gone)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import read_meminfo
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.loops.container_values import MAX_KEPT, NOTES, ContainerValues
from reconciler.loops.drift import DriftLoop
from reconciler.loops.kubelet_notes import KUBELET_NOTES, KubeletNotes, decode, encode, noted
from tests.support.fakesys import GIB, MIB, FakeHost

UID = "66666666-0000-0000-0000-000000000006"
OOM = "qos.nri-qos.io/oom-score-adj"
KUBELETS = 300


class Node:
    """A v2 host with one burstable pod whose annotation asks for a score, and drift over it
    keeping its notes in ``state_dir``."""

    def __init__(self, tmp_path: Path) -> None:
        self.host = FakeHost(tmp_path / "host", version=2)
        self.host.set_numa([(8 * GIB, 16 * GIB, 100)])
        self.pod = self.host.add_pod(UID, memory_limit=512 * MIB, memory_request=64 * MIB,
                                     annotations={OOM: "500"})
        self.c = self.pod.containers[0]
        self.set_score(KUBELETS)
        self.path = tmp_path / "state" / "state.json"
        self.config = Config()
        self.sink = MemoryAuditSink()
        self.now = 0.0

    def drift(self, state: NodeState) -> tuple[DriftLoop, StateFile]:
        """A run's drift: its own state-file object over the one file, as a new process has."""
        notes = StateFile(str(self.path))
        sysfs = SysFs(self.host.root, AuditLog(self.sink))
        loop = DriftLoop(lambda: self.config, state, sysfs, layout_for(sysfs),
                         read_meminfo(sysfs).get("MemTotal", 0), notes=notes)
        return loop, notes

    def synced(self, state: NodeState, score: int | None = KUBELETS) -> NodeState:
        pods, containers = self.host.nri()
        state.replace_all(pods, [dataclasses.replace(c, oom_score_adj=score)
                                 for c in containers])
        return state

    def cycle(self, loop: DriftLoop) -> None:
        self.now += 10.0
        loop.cycle(self.now)

    def score(self) -> int:
        return int((self.host.root / "proc" / str(self.c.pids[0]) / "oom_score_adj").read_text())

    def set_score(self, value: int) -> None:
        (self.host.root / "proc" / str(self.c.pids[0]) / "oom_score_adj").write_text(f"{value}\n")

    def section(self, name: str) -> dict[str, str]:
        entries: dict[str, str] = json.loads(self.path.read_text()).get(name, {})
        return entries

    def files(self, name: str) -> dict[str, object]:
        """The files of the container that the section's note names."""
        note = self.section(name).get(self.c.info.id)
        if note is None:
            return {}
        files: dict[str, object] = json.loads(note)[1]
        return files

    def writes(self) -> list[str]:
        return [r["path"] for r in self.sink.named("cgroup_write")]


def test_before_the_runtimes_first_list_drift_writes_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path)
    first, _ = node.drift(node.synced(NodeState()))
    node.cycle(first)
    kubepods = node.host.cg("", "kubepods") / "memory.low"
    assert kubepods.read_text().strip() == str(64 * MIB)  # the sum of its pods' protection
    written = len(node.writes())
    # The next run, before the runtime has listed anything.
    second, _ = node.drift(NodeState())
    node.cycle(second)
    node.cycle(second)
    assert kubepods.read_text().strip() == str(64 * MIB)
    assert node.writes()[written:] == []


def test_the_notes_of_a_run_give_a_score_back_after_a_restart_with_it_off(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    first, _ = node.drift(node.synced(NodeState()))
    node.cycle(first)
    assert node.score() == 500
    assert "oom_score_adj" in node.files(NOTES)
    # The next run starts with the score switched off.
    node.config = dataclasses.replace(Config(), oom=dataclasses.replace(Config().oom,
                                                                        enabled=False))
    second, _ = node.drift(node.synced(NodeState()))
    assert second.noted_containers() == 1
    node.cycle(second)
    assert node.score() == KUBELETS
    assert "oom_score_adj" not in node.files(NOTES)


def test_notes_of_containers_gone_during_the_restart_are_dropped(tmp_path: Path) -> None:
    node = Node(tmp_path)
    first, _ = node.drift(node.synced(NodeState()))
    node.cycle(first)
    assert node.section(NOTES)
    state = NodeState()
    state.replace_all([], [])  # the pod went while the agent was down
    second, _ = node.drift(state)
    node.cycle(second)
    assert node.section(NOTES) == {}
    assert second.noted_containers() == 0


def test_notes_that_do_not_read_as_notes_are_left_out_and_said(tmp_path: Path) -> None:
    node = Node(tmp_path)
    cgroup = "/sys/fs/cgroup/kubepods/burstable/x"
    node.path.parent.mkdir()
    node.path.write_text(json.dumps({NOTES: {
        "c1": json.dumps([cgroup, {"oom_score_adj": [None, "500", None],
                                   "memory.low": ["0", "1", "0"]}]),
        "c2": json.dumps([cgroup, {"../../etc/passwd": [None, "1", None]}]),  # not drift's
        "c3": json.dumps([cgroup, {}]),
        "c4": json.dumps(["", {"memory.low": [None, "1", None]}]),
        "c5": json.dumps([cgroup, {"memory.low": [5, "1", None]}]),
        "c6": json.dumps([cgroup, {"memory.low": [None, None, None]}]),
        "c7": json.dumps([cgroup, {"memory.low": [None, "1"]}]),
        "c8": "[1, 2]",
        "c9": "not json",
    }}))
    with capture_logs() as logs:
        loop, _ = node.drift(NodeState())
    assert loop.noted_containers() == 1
    assert sorted(e["key"] for e in logs if e["event"] == "state_note_invalid") == [
        f"c{i}" for i in range(2, 10)]


def test_the_state_file_keeps_the_notes_of_max_kept_containers(tmp_path: Path) -> None:
    values = ContainerValues(SysFs(tmp_path, AuditLog(MemoryAuditSink())),
                             layout_for(SysFs(tmp_path, AuditLog(MemoryAuditSink()))))
    note = json.dumps(["/sys/fs/cgroup/x", {"memory.low": [None, "1", None]}])
    values.take({f"c{i}": note for i in range(MAX_KEPT + 1)})
    assert len(values) == MAX_KEPT + 1
    kept = values.noted()
    assert len(kept) == MAX_KEPT
    assert f"c{MAX_KEPT}" not in kept
    assert kept["c0"] == note


def test_kubelets_values_are_noted_after_the_first_list_and_follow_the_containers(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    state = NodeState()
    loop, _ = node.drift(state)
    node.cycle(loop)
    assert not node.path.exists() or KUBELET_NOTES not in json.loads(node.path.read_text())
    node.synced(state)
    node.cycle(loop)
    assert node.section(KUBELET_NOTES) == {node.c.info.id: f"{64 * MIB},{KUBELETS},"}
    written = node.path.stat().st_mtime_ns, node.path.stat().st_ino
    node.cycle(loop)
    assert (node.path.stat().st_mtime_ns, node.path.stat().st_ino) == written  # unchanged
    state.remove_container(node.c.info, Event.REMOVE_CONTAINER)
    node.cycle(loop)
    assert KUBELET_NOTES not in json.loads(node.path.read_text())


def test_the_first_list_after_a_restart_takes_kubelets_values_from_the_notes() -> None:
    listed = dataclasses.replace(_container("c1"), memory_request=2 * MIB, oom_score_adj=500,
                                 memory_high=str(100 * MIB))
    state = NodeState(earlier={"c1": (MIB, KUBELETS, str(400 * MIB)), "c2": (None, 900, None)})
    state.replace_all([_pod()], [listed])
    known = state.container("c1")
    assert known is not None
    assert (known.memory_request, known.oom_score_adj, known.memory_high) == (
        MIB, KUBELETS, str(400 * MIB))
    # A later list (a reconnect) keeps what the events said, not the notes of the earlier run.
    state.put_container("sandbox-1", dataclasses.replace(listed, oom_score_adj=200),
                        Event.CREATE_CONTAINER)
    again = dataclasses.replace(_container("c2"), oom_score_adj=500)
    state.replace_all([_pod()], [listed, again])
    c1, c2 = state.container("c1"), state.container("c2")
    assert c1 is not None
    assert c2 is not None
    assert c1.oom_score_adj == 200
    assert c2.oom_score_adj == 500


def test_kubelet_notes_read_back_as_written() -> None:
    assert decode(encode((MIB, KUBELETS, None))) == (MIB, KUBELETS, None)
    assert decode(encode((MIB, -997, "max"))) == (MIB, -997, "max")
    assert decode(encode((MIB, None, str(2 * MIB)))) == (MIB, None, str(2 * MIB))
    assert decode(encode((None, None, None))) == (None, None, None)
    for bad in ("", "1", "1,2", "1,2,3,4", "x,1,", "1,y,", "1.5,2,", "1,2,huge", "1,2,-1",
                "1,2,²"):
        assert decode(bad) is None


def test_unreadable_kubelet_notes_are_left_out_and_said(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({KUBELET_NOTES: {"c1": "1,2,", "c2": "x"}}))
    with capture_logs() as logs:
        values = noted(StateFile(str(path)))
    assert values == {"c1": (1, 2, None)}
    assert [e["key"] for e in logs if e["event"] == "state_note_invalid"] == ["c2"]


def _pod() -> PodInfo:
    return PodInfo(id="sandbox-1", uid="uid-1", name="p", namespace="default")


def _container(cid: str) -> ContainerInfo:
    return ContainerInfo(id=cid, pod_sandbox_id="sandbox-1", name=cid)


def test_the_state_file_keeps_kubelets_values_of_max_kept_containers(tmp_path: Path) -> None:
    state = NodeState()
    state.replace_all([_pod()], [_container(f"c{i}") for i in range(MAX_KEPT + 1)])
    notes = StateFile(str(tmp_path / "state.json"))
    KubeletNotes(state, notes).save()
    kept = notes.entries(KUBELET_NOTES)
    assert len(kept) == MAX_KEPT
    assert f"c{MAX_KEPT}" not in kept


def test_an_idle_cycle_does_not_serialise_the_notes_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(tmp_path)
    loop, _ = node.drift(node.synced(NodeState()))
    node.cycle(loop)
    serialised = []
    noted_before = ContainerValues.noted

    def counted(self: ContainerValues) -> dict[str, str]:
        serialised.append(1)
        return noted_before(self)

    monkeypatch.setattr(ContainerValues, "noted", counted)
    node.cycle(loop)
    node.cycle(loop)
    assert serialised == []
    node.config = dataclasses.replace(Config(), oom=dataclasses.replace(Config().oom,
                                                                        enabled=False))
    node.cycle(loop)  # the score goes back: its note goes
    assert serialised == [1]
    assert "oom_score_adj" not in node.files(NOTES)
