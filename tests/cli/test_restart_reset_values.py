"""``nri-qos reset`` gives back the container values drift noted (kept in the state file for the
agent's next run): each file and process that still holds drift's last value gets the value from
before, or kubelet's; a refused write keeps its note and fails the step."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.cli.reset import reset
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import read_meminfo
from reconciler.host.statefile import state_file
from reconciler.host.sysfs import SysFs
from reconciler.loops.container_values import NOTES
from reconciler.loops.drift import DriftLoop
from reconciler.loops.kubelet_notes import KUBELET_NOTES
from tests.support.fakesys import GIB, MIB, FakeHost
from tests.support.refusals import refuse_writes

UID = "55555555-0000-0000-0000-000000000005"
KUBELETS = 300


class Node:
    """A v2 node an agent ran on: drift gave a burstable container's processes the score its
    annotation asks for, over kubelet's, and its memory.low."""

    def __init__(self, tmp_path: Path) -> None:
        self.host = FakeHost(tmp_path / "host", version=2)
        self.host.set_numa([(8 * GIB, 16 * GIB, 100)])
        pod = self.host.add_pod(UID, memory_limit=512 * MIB, memory_request=64 * MIB,
                                annotations={"qos.nri-qos.io/oom-score-adj": "500"})
        self.c = pod.containers[0]
        self.proc = self.host.root / "proc" / str(self.c.pids[0]) / "oom_score_adj"
        self.proc.write_text(f"{KUBELETS}\n")
        self.low = self.host.cg("", self.c.rel) / "memory.low"
        base = Config()
        self.cfg = dataclasses.replace(base, reconciler=dataclasses.replace(
            base.reconciler, root=str(self.host.root), state_dir=str(tmp_path / "state"),
            cgroup_driver="cgroupfs"))
        self.state_path = tmp_path / "state" / "state.json"
        sysfs = SysFs(self.host.root, AuditLog(MemoryAuditSink()))
        state = NodeState()
        pods, containers = self.host.nri()
        state.replace_all(pods, [dataclasses.replace(c, oom_score_adj=KUBELETS)
                                 for c in containers])
        DriftLoop(lambda: self.cfg, state, sysfs, layout_for(sysfs),
                  read_meminfo(sysfs).get("MemTotal", 0),
                  notes=state_file(self.cfg.reconciler.state_dir)).cycle(10.0)

    def score(self) -> int:
        return int(self.proc.read_text())

    def sections(self) -> dict[str, dict[str, str]]:
        doc: dict[str, dict[str, str]] = json.loads(self.state_path.read_text())
        return doc

    def reset(self, *, dry_run: bool = False) -> tuple[int, str]:
        out = io.StringIO()
        code = reset(self.cfg, AuditLog(MemoryAuditSink()), dry_run=dry_run, out=out,
                     kubernetes=False)
        return code, out.getvalue()


def test_reset_gives_back_what_drift_set_on_containers(tmp_path: Path) -> None:
    node = Node(tmp_path)
    assert node.score() == 500
    assert node.low.read_text().strip() == str(64 * MIB)
    assert set(node.sections()) >= {NOTES, KUBELET_NOTES}

    code, out = node.reset(dry_run=True)
    assert code == 0
    assert "drift: give back the values of 1 container(s)" in out
    assert node.score() == 500

    code, out = node.reset()
    assert code == 0, out
    assert "gave back the values of 1 container(s)" in out
    assert node.score() == KUBELETS
    assert node.low.read_text().strip() == "0"
    assert not set(node.sections()) & {NOTES, KUBELET_NOTES}
    # Idempotent: nothing left to give back.
    code, out = node.reset()
    assert code == 0
    assert "drift" not in out


def test_a_refused_write_back_keeps_its_note_and_fails_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(tmp_path)
    refuse_writes(monkeypatch, errno.EACCES, lambda path, _: path.endswith("/memory.low"))
    code, out = node.reset()
    assert code == 1
    assert "failed (1 container(s) not given back, kept in the state file" in out
    assert node.score() == KUBELETS
    files = json.loads(node.sections()[NOTES][node.c.info.id])[1]
    assert set(files) == {"memory.low"}
    assert KUBELET_NOTES in node.sections()  # still needed for what is left
    monkeypatch.undo()
    code, out = node.reset()
    assert code == 0, out
    assert node.low.read_text().strip() == "0"
