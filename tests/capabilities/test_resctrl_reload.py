"""A reload reaches the resctrl groups of a running agent: switched off, every group of ours goes;
a pod group the configuration no longer gives its pod takes no new container; in observe mode no
group limits anything; back in enforce mode the limits return; a changed group prefix waits for
the next start. An agent started with resctrl switched off removes the groups an earlier run
left. The agent as the daemon builds it, on a fake host."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from hooks.events import Event
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION
from nri_plugin.agent import Agent, build_agent, probe
from nri_plugin.config.store import ConfigStore
from nri_plugin.session.stub import PluginIdentity
from protos import nri_api_pb2 as api
from reconciler.host.resctrlfs import ResctrlFs
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
HALF = "L3:0=3f;1=3f\nMB:0=100;1=100\n"


class Node:
    """The agent on a fake host; ``before`` runs on the host before the agent starts (an
    earlier run's groups), ``extra`` is added to the configuration it starts with."""

    def __init__(self, tmp_path: Path, *, extra: str = "", run_background: bool = False,
                 before: Callable[[FakeHost], object] = FakeHost.make_resctrl) -> None:
        self.host = FakeHost(tmp_path / "host")
        before(self.host)
        self.resctrl = self.host.root / "sys/fs/resctrl"
        self.config = tmp_path / "config.toml"
        self.state_dir = tmp_path / "state"
        self.sink = MemoryAuditSink()
        audit = AuditLog(self.sink)
        self.write(extra=extra)
        self.store = ConfigStore(audit)
        self.store.load_initial(self.config)
        host, sysfs = probe(self.store.current, audit)
        self.agent: Agent = build_agent(self.store, audit, host, sysfs,
                                        PluginIdentity("nri-qos", "10"),
                                        run_background=run_background)

    def write(self, mode: str = "enforce", extra: str = "") -> None:
        self.config.write_text(f'[agent]\nmode = "{mode}"\n'
                               f'[reconciler]\nroot = "{self.host.root}"\n'
                               f'state_dir = "{self.state_dir}"\n'
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

    def create_container(self) -> str:
        """The CLOS of the answer to a CreateContainer in the pod of :meth:`run_pod`."""
        pod = api.PodSandbox(id="sb-1", uid=UID, name="p", namespace="ns",
                             annotations={KOORDINATOR_ANNOTATION: RECORDED})
        pod.linux.cgroup_parent = f"/kubepods/burstable/pod{UID}"
        container = api.Container(id="c-1", pod_sandbox_id="sb-1", name="c")
        answer = self.agent.stub.events.handle(Event.CREATE_CONTAINER, pod, container,
                                               self.agent.stub.terms)
        assert isinstance(answer, bytes)
        reply = api.CreateContainerResponse.FromString(answer)
        return reply.adjust.linux.resources.rdt_class.value

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


@pytest.mark.parametrize(("mode", "extra"), [
    ("enforce", "[resctrl]\npod_groups = false\n"),
    # The pod's annotation is Koordinator's: no longer honoured.
    ("enforce", "[resctrl]\nkoordinator_annotation = false\n"),
    # Its level's share no longer admits the request (L3 [20, 80], MB 20 %).
    ("enforce", "[resctrl.levels.shared_cores]\nl3_end_percent = 79\nmb_percent = 19\n"),
    ("observe", "[resctrl]\npod_groups = false\n"),
])
async def test_a_reload_that_gives_a_live_pod_no_group_of_its_own_stops_placing_in_it(
        node: Node, mode: str, extra: str) -> None:
    await node.run_pod()
    assert node.create_container() == POD_GROUP
    node.reload(mode=mode, extra=extra)
    # Left for the task-id loop, which collects it after its grace
    # (tests/loops/test_loop_resctrl_tasks.py): a CreateContainer that named it a moment ago
    # must still find it. New containers go to their level's group.
    assert node.groups() == ALL_GROUPS
    assert node.sink.named("resctrl_group_removed") == []
    assert node.create_container() == "nriqos-shared_cores"


@pytest.mark.parametrize("extra", [
    # The request at the exact edge of the level's share and the caps: still admitted.
    "[resctrl.levels.shared_cores]\nl3_end_percent = 80\nmb_percent = 20\n",
    "[resctrl]\npod_l3_max_percent = 80\npod_mb_max_percent = 20\n",
    # Only another level's class group changes.
    "[resctrl.levels.reclaimed_cores]\nenabled = false\n",
])
async def test_a_reload_that_still_gives_the_pod_its_group_keeps_it(node: Node,
                                                                    extra: str) -> None:
    await node.run_pod()
    node.reload(extra=extra)
    assert POD_GROUP in node.groups()
    assert node.schemata(POD_GROUP) == POD_LIMIT
    assert POD_GROUP not in {r["group"] for r in node.sink.named("resctrl_group_removed")}


async def test_a_reload_changing_the_group_prefix_keeps_the_prefix_of_the_start(
        node: Node) -> None:
    await node.run_pod()
    node.write(extra='[resctrl]\ngroup_prefix = "other-"\n')
    assert node.store.reload() is False
    (said,) = node.sink.named("config_restart_needed")
    assert said["keys"] == {"resctrl.group_prefix": {"in_force": "nriqos-", "new": "other-"}}
    # The rest of a reload applies, to the groups of the start's prefix; none is left behind.
    node.reload(extra='[resctrl]\ngroup_prefix = "other-"\n'
                      "[resctrl.levels.reclaimed_cores]\nl3_end_percent = 50\n")
    await node.run_pod()
    assert node.groups() == ALL_GROUPS
    assert node.sink.named("resctrl_group_removed") == []
    assert node.schemata(POD_GROUP) == POD_LIMIT
    assert node.schemata("nriqos-reclaimed_cores") == HALF
    assert node.store.current.resctrl.group_prefix == "nriqos-"


def leftovers(host: FakeHost) -> None:
    """What an earlier run with resctrl on left: its class groups, a pod group with its monitor
    group; and a group that is not ours."""
    host.make_resctrl()
    for group in ALL_GROUPS:
        host.add_resctrl_group(group, monitor=group == POD_GROUP)
    host.add_resctrl_group("COS1")


def test_an_agent_started_with_resctrl_off_removes_the_groups_an_earlier_run_left(
        tmp_path: Path) -> None:
    node = Node(tmp_path, extra="[resctrl]\nenabled = false\n", run_background=True,
                before=leftovers)
    node.agent.executor.shutdown()
    assert node.groups() == ["COS1"]
    assert sorted((r["group"], r["reason"]) for r in node.sink.named("resctrl_group_removed")) == [
        (group, "resctrl.enabled is false") for group in ALL_GROUPS]


def test_a_group_the_kernel_will_not_remove_at_start_is_said_and_the_others_go(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remove_group = ResctrlFs.remove_group

    def busy(self: ResctrlFs, group: str, reason: str) -> bool:
        if group == POD_GROUP:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        return remove_group(self, group, reason)

    monkeypatch.setattr(ResctrlFs, "remove_group", busy)
    with capture_logs() as logs:
        node = Node(tmp_path, extra="[resctrl]\nenabled = false\n", run_background=True,
                    before=leftovers)
    node.agent.executor.shutdown()
    said = [(e["group"], e["error"]) for e in logs if e["event"] == "resctrl_group_not_removed"]
    assert said == [(POD_GROUP, "OSError: Device or resource busy")]
    assert node.groups() == ["COS1", POD_GROUP]


def test_an_agent_started_with_resctrl_off_and_not_mounted_does_nothing(tmp_path: Path) -> None:
    with capture_logs() as logs:
        node = Node(tmp_path, extra="[resctrl]\nenabled = false\n", run_background=True,
                    before=lambda host: None)
    node.agent.executor.shutdown()
    assert not node.resctrl.exists()
    assert [e for e in logs if "resctrl" in e["event"]] == []
    assert [name for name, _ in node.sink.records if "resctrl" in name] == []


@pytest.mark.parametrize(("extra", "run_background"), [
    # resctrl on: the groups are the agent's own.
    ("", True),
    # A simulation leaves the node as it is.
    ("[resctrl]\nenabled = false\n", False),
])
def test_an_agent_started_otherwise_leaves_the_groups(tmp_path: Path, extra: str,
                                                      run_background: bool) -> None:
    node = Node(tmp_path, extra=extra, run_background=run_background, before=leftovers)
    node.agent.executor.shutdown()
    assert node.groups() == sorted(["COS1", *ALL_GROUPS])
    assert node.sink.named("resctrl_group_removed") == []
