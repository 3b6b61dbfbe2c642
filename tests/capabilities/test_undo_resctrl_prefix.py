"""The resctrl groups of a ``group_prefix`` the agent no longer runs with: the prefix each run
made groups with is noted in the state file, so a start with another prefix (or with resctrl
off) and ``nri-qos reset`` remove the groups of the old one, which nothing else would ever find
again (each holds a CLOS of the few the hardware has)."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from hooks.events import Event
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION
from nri_plugin.agent import build_agent, probe
from nri_plugin.cli.reset import reset
from nri_plugin.config.store import ConfigStore
from nri_plugin.session.stub import PluginIdentity
from protos import nri_api_pb2 as api
from reconciler.host.statefile import state_file
from tests.support.builders import UID
from tests.support.fakesys import FakeHost

POD_GROUP = f"nriqos-pod-{UID}"
CLASS_GROUPS = ["nriqos-dedicated_cores", "nriqos-reclaimed_cores", "nriqos-shared_cores",
                "nriqos-system_cores"]
OTHER = '[resctrl]\ngroup_prefix = "other-"\n'
OTHER_CLASS_GROUPS = [group.replace("nriqos-", "other-") for group in CLASS_GROUPS]


class Node:
    """A fake host with resctrl, its state file and the agent's configuration file."""

    def __init__(self, tmp_path: Path) -> None:
        self.host = FakeHost(tmp_path / "host")
        self.host.make_resctrl()
        self.resctrl = self.host.root / "sys/fs/resctrl"
        self.config = tmp_path / "config.toml"
        self.state_dir = tmp_path / "state"

    def write(self, extra: str = "") -> None:
        self.config.write_text('[agent]\nmode = "enforce"\n'
                               f'[reconciler]\nroot = "{self.host.root}"\n'
                               f'state_dir = "{self.state_dir}"\n'
                               "[kubernetes]\nenabled = false\n[status]\nenabled = false\n"
                               + extra)

    async def start(self, extra: str = "", *, pod: bool = False) -> MemoryAuditSink:
        """An agent's start with ``extra`` in its configuration (and a pod asking for a group
        of its own, with ``pod``)."""
        self.write(extra)
        sink = MemoryAuditSink()
        audit = AuditLog(sink)
        store = ConfigStore(audit)
        store.load_initial(self.config)
        host, sysfs = probe(store.current, audit)
        agent = build_agent(store, audit, host, sysfs, PluginIdentity("nri-qos", "10"),
                            run_background=True)
        if pod:
            message = api.PodSandbox(id="sb-1", uid=UID, name="p", namespace="ns", annotations={
                KOORDINATOR_ANNOTATION: '{"LLC":{"schemata":{"range":[20,80]}}}'})
            message.linux.cgroup_parent = f"/kubepods/burstable/pod{UID}"
            answer = agent.stub.events.handle(Event.RUN_POD_SANDBOX, message, None,
                                              agent.stub.terms)
            if not isinstance(answer, bytes):
                await answer
        agent.executor.shutdown()
        return sink

    def groups(self) -> list[str]:
        return sorted(p.name for p in self.resctrl.iterdir()
                      if p.is_dir() and p.name not in ("info", "mon_groups", "mon_data"))


async def run_with_the_default_prefix(tmp_path: Path) -> Node:
    """A run that made its class groups and a pod group, and a group of someone else's."""
    node = Node(tmp_path)
    await node.start(pod=True)
    node.host.add_resctrl_group("COS1")
    assert node.groups() == sorted(["COS1", POD_GROUP, *CLASS_GROUPS])
    return node


async def test_a_start_with_another_group_prefix_removes_the_groups_of_the_old_one(
        tmp_path: Path) -> None:
    node = await run_with_the_default_prefix(tmp_path)
    sink = await node.start(OTHER)
    assert node.groups() == sorted(["COS1", *OTHER_CLASS_GROUPS])
    assert sorted(r["group"] for r in sink.named("resctrl_group_removed")) == sorted(
        [POD_GROUP, *CLASS_GROUPS])
    assert state_file(str(node.state_dir)).entries("resctrl_prefix") == {
        "other-": "/sys/fs/resctrl"}
    # The next start with the same prefix finds nothing more to remove.
    assert (await node.start(OTHER)).named("resctrl_group_removed") == []
    assert node.groups() == sorted(["COS1", *OTHER_CLASS_GROUPS])


async def test_a_start_with_resctrl_off_and_another_prefix_removes_both(tmp_path: Path) -> None:
    node = await run_with_the_default_prefix(tmp_path)
    await node.start(OTHER)
    await node.start('[resctrl]\nenabled = false\ngroup_prefix = "third-"\n')
    assert node.groups() == ["COS1"]
    assert state_file(str(node.state_dir)).entries("resctrl_prefix") == {}


async def test_reset_removes_the_groups_of_a_prefix_no_longer_configured(tmp_path: Path) -> None:
    node = await run_with_the_default_prefix(tmp_path)
    node.write(extra=OTHER)
    store = ConfigStore(AuditLog(MemoryAuditSink()))
    store.load_initial(node.config)
    cfg = store.current
    cfg = dataclasses.replace(cfg, status=dataclasses.replace(
        cfg.status, socket=str(tmp_path / "status.sock")))
    out = io.StringIO()
    code = reset(cfg, AuditLog(MemoryAuditSink()), dry_run=False, out=out, kubernetes=False)
    assert code == 0, out.getvalue()
    assert f"resctrl: remove group {POD_GROUP}: removed" in out.getvalue()
    assert node.groups() == ["COS1"]
    assert state_file(str(node.state_dir)).entries("resctrl_prefix") == {}
