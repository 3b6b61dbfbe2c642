"""A reload reaches the resctrl groups of a running agent: switched off, every group of ours goes;
in observe mode no group limits anything; back in enforce mode the limits return. The agent as
the daemon builds it, on a fake host."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from hooks.events import Event
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION
from nri_plugin.agent import Agent, build_agent, probe
from nri_plugin.config.store import ConfigStore
from nri_plugin.session.stub import PluginIdentity
from protos import nri_api_pb2 as api
from tests.support.builders import UID
from tests.support.fakesys import FakeHost

POD_GROUP = f"nriqos-pod-{UID}"
CLASS_GROUPS = ["nriqos-dedicated_cores", "nriqos-reclaimed_cores", "nriqos-shared_cores",
                "nriqos-system_cores"]
ALL_GROUPS = sorted([*CLASS_GROUPS, POD_GROUP])
RECORDED = '{"LLC":{"schemata":{"range":[20,80]}},"MB":{"schemata":{"percent":20}}}'
NO_LIMIT = "L3:0=7ff;1=7ff\nMB:0=100;1=100\n"
RECLAIMED = "L3:0=f;1=f\nMB:0=100;1=100\n"
POD_LIMIT = "L3:0=1fc;1=1fc\nMB:0=20;1=20\n"


class Node:
    def __init__(self, tmp_path: Path) -> None:
        self.host = FakeHost(tmp_path / "host")
        self.resctrl = self.host.make_resctrl()
        self.config = tmp_path / "config.toml"
        self.sink = MemoryAuditSink()
        audit = AuditLog(self.sink)
        self.write()
        self.store = ConfigStore(audit)
        self.store.load_initial(self.config)
        host, sysfs = probe(self.store.current, audit)
        self.agent: Agent = build_agent(self.store, audit, host, sysfs,
                                        PluginIdentity("nri-qos", "10"), run_background=False)

    def write(self, mode: str = "enforce", extra: str = "") -> None:
        self.config.write_text(f'[agent]\nmode = "{mode}"\n'
                               f'[reconciler]\nroot = "{self.host.root}"\n'
                               "[kubernetes]\nenabled = false\n[status]\nenabled = false\n"
                               + extra)

    def reload(self, mode: str = "enforce", extra: str = "") -> None:
        self.write(mode, extra)
        assert self.store.reload()

    async def run_pod(self) -> None:
        """RunPodSandbox of a Burstable pod (shared_cores) asking for its own group."""
        message = api.PodSandbox(id="sb-1", uid=UID, name="p", namespace="ns",
                                 annotations={KOORDINATOR_ANNOTATION: RECORDED})
        message.linux.cgroup_parent = f"/kubepods/burstable/pod{UID}"
        answer = self.agent.stub.events.handle(Event.RUN_POD_SANDBOX, message, None,
                                               self.agent.stub.terms)
        if not isinstance(answer, bytes):
            await answer

    def groups(self) -> list[str]:
        return sorted(p.name for p in self.resctrl.iterdir()
                      if p.is_dir() and p.name not in ("info", "mon_groups", "mon_data"))

    def schemata(self, group: str) -> str:
        return (self.resctrl / group / "schemata").read_text()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path)
    yield made
    made.agent.executor.shutdown()


async def test_switched_off_every_group_goes_and_switched_on_the_class_groups_return(
        node: Node) -> None:
    await node.run_pod()
    assert node.groups() == ALL_GROUPS
    made = len(node.sink.named("resctrl_group_created"))
    # The same reload changes a level: nothing is written for a group that goes.
    node.reload(extra="[resctrl]\nenabled = false\n"
                      "[resctrl.levels.reclaimed_cores]\nmb_percent = 30\n")
    assert node.groups() == []
    assert sorted((r["group"], r["reason"]) for r in node.sink.named("resctrl_group_removed")) == [
        (group, "resctrl.enabled is false") for group in ALL_GROUPS]
    assert len(node.sink.named("resctrl_group_created")) == made
    await node.run_pod()
    assert node.groups() == []
    node.reload()
    # The pod's own group is made by its next sandbox; until then it is placed by its level.
    assert node.groups() == CLASS_GROUPS
    assert node.schemata("nriqos-reclaimed_cores") == RECLAIMED


async def test_observe_mode_lifts_every_limit_and_enforce_brings_them_back(node: Node) -> None:
    await node.run_pod()
    assert node.schemata("nriqos-reclaimed_cores") == RECLAIMED
    assert node.schemata(POD_GROUP) == POD_LIMIT
    node.reload(mode="observe")
    assert node.schemata("nriqos-reclaimed_cores") == NO_LIMIT
    assert node.schemata(POD_GROUP) == NO_LIMIT
    lifted = {r["group"] for r in node.sink.named("resctrl_group_created")
              if r["reason"] == "observe mode: no limit (the kernel's default)"}
    assert lifted == {"nriqos-reclaimed_cores", POD_GROUP}
    node.reload(mode="enforce")
    assert node.schemata("nriqos-reclaimed_cores") == RECLAIMED
    assert node.schemata(POD_GROUP) == POD_LIMIT
