"""``nri-qos reset``: everything the agent placed on the node goes, idempotently; ``--dry-run``
says what would go and changes nothing; a running agent stops it."""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import socket
import tomllib
from pathlib import Path

import pytest
import yaml

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.cli import main
from nri_plugin.cli.nri_qos import build_parser
from nri_plugin.cli.reset import main_reset, reset
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.resctrlfs import ResctrlFs
from reconciler.host.statefile import state_file
from reconciler.host.sysfs import SysFs
from reconciler.kube import KubernetesConfig
from reconciler.loops.cpu_idle import CpuIdleLoop
from reconciler.loops.memory_guard import MemoryGuardLoop
from reconciler.loops.numa_binding import NUMA_BALANCE_NOTES
from reconciler.loops.protection import PROTECTION_NOTES, WRITTEN_NOTES, AncestorProtection
from tests.support.fake_apiserver import FakeApiServer, write_kubeconfig
from tests.support.fakesys import GIB, FakeHost
from tests.support.guard_config import standing
from tests.support.paths import REPO
from tests.support.refusals import refuse_writes

TAINT = "nri-qos.io/memory-pressure"


@dataclasses.dataclass
class Node:
    host: FakeHost
    cfg: Config
    sink: MemoryAuditSink

    def tree(self) -> dict[str, str]:
        return {str(p.relative_to(self.host.root)): p.read_text()
                for p in sorted(self.host.root.rglob("*")) if p.is_file()}

    def run(self, *, dry_run: bool = False, kubernetes: bool = False) -> tuple[int, str]:
        out = io.StringIO()
        code = reset(self.cfg, AuditLog(self.sink), dry_run=dry_run, out=out,
                     kubernetes=kubernetes)
        return code, out.getvalue()


@pytest.fixture
def node(tmp_path: Path) -> Node:
    """A v2 node an agent ran on: the guard's cap, the tier's cpu.idle, a wmark_ratio, a
    protected kubepods, two resctrl groups of the agent's and one of someone else's, its status
    socket."""
    host = FakeHost(tmp_path / "host", version=2, driver="systemd")
    host.set_numa([(8 * GIB, 32 * GIB, 0)])
    host.set_tier_usage("besteffort", 2 * GIB, per_node=[2 * GIB])
    host.make_resctrl()
    for group in ("nriqos-shared_cores", "nriqos-pod-1234", "other-tool"):
        host.add_resctrl_group(group)
    cfg = standing()  # the v2 node's cap: a standing one
    cfg = dataclasses.replace(
        cfg, reconciler=dataclasses.replace(cfg.reconciler, root=str(host.root),
                                            state_dir=str(tmp_path / "state")),
        status=dataclasses.replace(cfg.status, socket=str(tmp_path / "status.sock")))
    sink = MemoryAuditSink()
    sysfs = SysFs(host.root, AuditLog(sink))
    MemoryGuardLoop(lambda: cfg, sysfs, layout_for(sysfs), AuditLog(sink),
                    notes=state_file(cfg.reconciler.state_dir)).cycle(0.0)
    (host.tier_dir("besteffort") / "cpu.idle").write_text("0\n")
    idle = dataclasses.replace(cfg, cpu_idle=dataclasses.replace(cfg.cpu_idle, enabled=True))
    CpuIdleLoop(lambda: idle, sysfs, layout_for(sysfs),
                state_file(cfg.reconciler.state_dir)).cycle(0.0)
    wmark = host.tier_dir("besteffort") / "memory.wmark_ratio"
    wmark.write_text("80\n")
    state_file(cfg.reconciler.state_dir).remember(
        "wmark_ratio", "/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice/"
        "memory.wmark_ratio", "95")
    # the protection drift gave kubepods above a protected container
    (host.tier_dir("guaranteed") / "memory.min").write_text(f"{512 << 20}\n")
    state_file(cfg.reconciler.state_dir).remember(
        "protection", "/sys/fs/cgroup/kubepods.slice/memory.min", "0")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(cfg.status.socket)
    listener.close()  # the socket file an agent that died left behind
    return Node(host, cfg, sink)


def test_a_dry_run_leaves_an_invalid_state_file_where_it_is(node: Node) -> None:
    """A real reset sets an invalid state file aside (``.bad``) and starts from nothing; a dry
    run changes nothing on the node, that file included."""
    path = Path(node.cfg.reconciler.state_dir) / "state.json"
    path.write_text("{not json")
    node.run(dry_run=True)
    assert path.read_text() == "{not json"
    assert not Path(f"{path}.bad").exists()
    node.run()
    assert Path(f"{path}.bad").read_text() == "{not json"


def test_dry_run_says_everything_and_changes_nothing(node: Node) -> None:
    before = node.tree()
    writes = len(node.sink.records)
    code, out = node.run(dry_run=True)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("would memory guard: restore /sys/fs/cgroup/kubepods.slice/"
                               "kubepods-besteffort.slice/memory.high to max, ")
    assert lines[1:] == [
        "would cpu idle: restore /sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice/"
        "cpu.idle to 0",
        "would memory QoS: restore memory.min/memory.low of 1 pod or tier file(s)",
        "would tune: restore memory.wmark_ratio of 1 pod(s)",
        "would resctrl: remove group nriqos-pod-1234",
        "would resctrl: remove group nriqos-shared_cores",
        f"would status: remove socket {node.cfg.status.socket}",
    ]
    assert node.tree() == before
    assert Path(node.cfg.status.socket).exists()
    assert len(node.sink.records) == writes


def test_reset_takes_everything_away_and_a_second_reset_finds_nothing(node: Node) -> None:
    code, out = node.run()
    assert code == 0, out
    tier = node.host.tier_dir("besteffort")
    assert (tier / "memory.max").read_text().strip() == "max"
    assert (tier / "memory.high").read_text().strip() == "max"
    assert (tier / "memory.wmark_ratio").read_text().strip() == "95"
    assert (tier / "cpu.idle").read_text().strip() == "0"
    assert (node.host.tier_dir("guaranteed") / "memory.min").read_text().strip() == "0"
    resctrl = node.host.root / "sys/fs/resctrl"
    assert not (resctrl / "nriqos-shared_cores").exists()
    assert not (resctrl / "nriqos-pod-1234").exists()
    assert (resctrl / "other-tool").is_dir()
    assert not Path(node.cfg.status.socket).exists()
    assert [r["group"] for r in node.sink.named("resctrl_group_removed")] == [
        "nriqos-pod-1234", "nriqos-shared_cores"]
    assert node.run() == (0, "nothing to undo\n")


def test_a_running_agent_stops_the_reset(node: Node, tmp_path: Path) -> None:
    Path(node.cfg.status.socket).unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(node.cfg.status.socket)
    listener.listen()
    config = tmp_path / "config.toml"
    config.write_text(f'[reconciler]\nroot = "{node.host.root}"\n'
                      f'state_dir = "{node.cfg.reconciler.state_dir}"\n'
                      f'[status]\nsocket = "{node.cfg.status.socket}"\n'
                      "[kubernetes]\nenabled = false\n")
    before = node.tree()
    err = io.StringIO()
    try:
        assert main_reset(str(config), dry_run=False, out=io.StringIO(), err=err) == 1
    finally:
        listener.close()
    assert "an agent answers on" in err.getvalue()
    assert node.tree() == before
    # Gone: the reset runs.
    out = io.StringIO()
    assert main_reset(str(config), dry_run=False, out=out, err=err) == 0
    assert "memory guard: restore" in out.getvalue()


def test_an_invalid_configuration_stops_the_reset_naming_each_file_once(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[plugin]\nstrict = 1\n")
    (tmp_path / "config.toml.d").mkdir()
    drop_in = tmp_path / "config.toml.d" / "50-x.toml"
    drop_in.write_text("[numa]\nenabeld = true\n")
    out, err = io.StringIO(), io.StringIO()
    assert main_reset(str(config), dry_run=True, out=out, err=err) == 2
    assert out.getvalue() == ""
    lines = err.getvalue().splitlines()
    assert lines[0] == f"{config}: plugin.strict: must be a boolean, got integer"
    assert lines[1].startswith(f"{drop_in}: numa.enabeld: unknown key (known keys: ")
    assert len(lines) == 2


def test_the_command_line_has_reset() -> None:
    args = build_parser().parse_args(["reset", "--dry-run", "--config", "/x.toml"])
    assert (args.command, args.dry_run, args.config) == ("reset", True, "/x.toml")
    assert build_parser().parse_args(["reset"]).dry_run is False
    with pytest.raises(SystemExit):
        main(["reset", "--force"])


def test_reset_clears_the_taint_and_condition_under_every_key_placed(
        node: Node, tmp_path: Path) -> None:
    with FakeApiServer() as fake:
        fake.add_node("node-a", taints=[{"key": TAINT, "effect": "NoSchedule"},
                                        {"key": "example.com/old", "effect": "NoSchedule"},
                                        {"key": "dedicated", "effect": "NoSchedule"}],
                      conditions=[{"type": "Ready", "status": "True"},
                                  {"type": "NriQosMemoryPressure", "status": "True"},
                                  {"type": "NriQosSystemMemoryPressure", "status": "False"}])
        notes = state_file(node.cfg.reconciler.state_dir)
        notes.put("taint", "example.com/old", "NoSchedule")
        kube = KubernetesConfig(kubeconfig=str(write_kubeconfig(tmp_path / "kc", fake.url)),
                                node_name="node-a", request_timeout_s=5.0)
        node.cfg = dataclasses.replace(node.cfg, kubernetes=kube)
        code, out = node.run(dry_run=True, kubernetes=True)
        assert "would node node-a: remove taint example.com/old" in out
        assert len(fake.taints("node-a")) == 3
        code, out = node.run(kubernetes=True)
        assert code == 0, out
        assert "node node-a: remove taint example.com/old: removed" in out
        assert f"node node-a: remove taint {TAINT}: removed" in out
        assert fake.taints("node-a") == [{"key": "dedicated", "effect": "NoSchedule"}]
        assert list(fake.conditions("node-a")) == ["Ready"]
        assert "node node-a: remove condition NriQosSystemMemoryPressure: removed" in out
        code, out = node.run(kubernetes=True)
        assert code == 0
        assert f"node node-a: remove taint {TAINT}: not there" in out
        assert "node node-a: remove condition NriQosMemoryPressure: not there" in out
        assert list(fake.conditions("node-a")) == ["Ready"]


def test_the_uninstall_job_runs_reset_on_the_agents_state_and_host_files() -> None:
    (job,) = [d for d in yaml.safe_load_all(
        (REPO / "deploy" / "uninstall" / "reset-job.yaml").read_text()) if d]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:2] == ["nri-qos", "reset"]
    build_parser().parse_args(container["command"][1:])
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    shipped = tomllib.loads(
        (REPO / "deploy" / "kustomize" / "base" / "00-daemonset.toml").read_text())
    root = shipped["reconciler"]["root"]
    state_dir = Config().reconciler.state_dir
    assert mounts[state_dir]["hostPath"]["path"] == state_dir
    # cgroups and resctrl, as the DaemonSet mounts them
    assert mounts[root + "/sys/fs"]["hostPath"]["path"] == "/sys/fs"
    assert mounts["/etc/nri-qos/config.toml.d"] == volumes["config"]
    assert pod["serviceAccountName"] == "nri-qos"


def test_reset_writes_back_what_the_numa_balance_changed(node: Node) -> None:
    pod = node.host.add_pod("33333333-0000-0000-0000-000000000003", tier="besteffort")
    mems = node.host.cg("cpuset", pod.containers[0].rel) / "cpuset.mems"
    mems.write_text("0-1\n")
    state_file(node.cfg.reconciler.state_dir).remember(
        NUMA_BALANCE_NOTES, f"/sys/fs/cgroup/{pod.containers[0].rel}/cpuset.mems", "0")
    code, out = node.run(dry_run=True)
    assert "would NUMA balance: restore cpuset.mems of 1 container(s)" in out.splitlines()
    assert mems.read_text() == "0-1\n"
    code, out = node.run()
    assert code == 0, out
    assert "NUMA balance: restore cpuset.mems of 1 container(s): restored 1 file(s)" in out
    assert mems.read_text().strip() == "0"
    assert state_file(node.cfg.reconciler.state_dir).entries(NUMA_BALANCE_NOTES) == {}


def test_reset_leaves_a_protection_someone_else_changed_since_the_agents_last_write(
        node: Node) -> None:
    """The fixture's kubepods note holds no last write (written back whatever the file holds);
    the tier's protection, raised by a run that noted its write, is kubelet's since."""
    sysfs = SysFs(node.host.root, AuditLog(node.sink))
    tier = "kubepods.slice/kubepods-burstable.slice"
    AncestorProtection(sysfs, layout_for(sysfs), state_file(node.cfg.reconciler.state_dir)
                       ).apply({"kubepods.slice": {"memory.min": 512 << 20},
                                tier: {"memory.low": 256 << 20}}, "drift")
    low = node.host.tier_dir("burstable") / "memory.low"
    assert low.read_text() == str(256 << 20)
    low.write_text(f"{GIB}\n")  # kubelet's MemoryQoS, after the agent stopped
    code, out = node.run()
    assert code == 0, out
    assert ("memory QoS: restore memory.min/memory.low of 2 pod or tier file(s): restored 1 "
            "file(s)") in out.splitlines()
    assert low.read_text().strip() == str(GIB)
    assert (node.host.tier_dir("guaranteed") / "memory.min").read_text().strip() == "0"
    notes = state_file(node.cfg.reconciler.state_dir)
    assert (notes.entries(PROTECTION_NOTES), notes.entries(WRITTEN_NOTES)) == ({}, {})


def test_reset_forgets_a_last_write_noted_without_a_value_from_before(node: Node) -> None:
    """A run cut short between writing a file back and dropping its last write leaves that
    note alone: nothing to restore, but the reset takes it away and the file is not touched."""
    assert node.run()[0] == 0
    low = node.host.tier_dir("burstable") / "memory.low"
    low.write_text(f"{GIB}\n")
    path = "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/memory.low"
    state_file(node.cfg.reconciler.state_dir).put(WRITTEN_NOTES, path, str(256 << 20))
    assert node.run(dry_run=True) == (0, "would memory QoS: forget the last write to 1 file(s) "
                                         "noted without a value from before\n")
    assert node.run() == (0, "memory QoS: forget the last write to 1 file(s) noted without a "
                             "value from before: restored 0 file(s)\n")
    notes = state_file(node.cfg.reconciler.state_dir)
    assert (notes.entries(PROTECTION_NOTES), notes.entries(WRITTEN_NOTES)) == ({}, {})
    assert low.read_text() == f"{GIB}\n"
    assert node.run() == (0, "nothing to undo\n")


def test_a_write_the_kernel_refuses_fails_the_reset_and_keeps_its_note(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    idle = "/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice/cpu.idle"
    tier = node.host.tier_dir("besteffort")
    (tier / "cpu.idle").write_text("1\n")
    with monkeypatch.context() as refusing:
        refuse_writes(refusing, errno.EACCES, lambda real, _: real.endswith("/cpu.idle"))
        code, out = node.run()
    assert code == 1
    assert (f"cpu idle: restore {idle} to 0: failed (1 file(s) not restored, kept in the "
            f"state file: {idle})") in out.splitlines()
    # the other steps ran
    assert (tier / "memory.max").read_text().strip() == "max"
    assert not Path(node.cfg.status.socket).exists()
    assert state_file(node.cfg.reconciler.state_dir).entries("cpu_idle") == {idle: "0"}
    code, out = node.run()
    assert (code, out) == (0, f"cpu idle: restore {idle} to 0: restored 1 file(s)\n")
    assert (tier / "cpu.idle").read_text().strip() == "0"
    assert node.run() == (0, "nothing to undo\n")


def test_a_group_the_kernel_will_not_remove_fails_the_reset_not_the_other_steps(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    remove_group = ResctrlFs.remove_group

    def busy(self: ResctrlFs, group: str, reason: str) -> bool:
        if group == "nriqos-pod-1234":
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        return remove_group(self, group, reason)

    monkeypatch.setattr(ResctrlFs, "remove_group", busy)
    code, out = node.run()
    assert code == 1
    assert ("resctrl: remove group nriqos-pod-1234: failed (OSError: Device or resource busy)"
            in out.splitlines())
    assert "resctrl: remove group nriqos-shared_cores: removed" in out.splitlines()
    assert not Path(node.cfg.status.socket).exists()
    monkeypatch.setattr(ResctrlFs, "remove_group", remove_group)
    assert node.run() == (0, "resctrl: remove group nriqos-pod-1234: removed\n")


def test_without_kubernetes_access_what_an_earlier_run_placed_is_said_to_stay(
        node: Node) -> None:
    notes = state_file(node.cfg.reconciler.state_dir)
    notes.put("taint", TAINT, "NoSchedule")
    notes.put("node_condition", "NriQosMemoryPressure", "True")
    node.cfg = dataclasses.replace(node.cfg, kubernetes=KubernetesConfig(enabled=False))
    code, out = node.run(kubernetes=True)
    assert code == 0
    assert out.splitlines()[0] == (
        f"note: [kubernetes] enabled is false: taint {TAINT}, condition NriQosMemoryPressure "
        "placed by an earlier run stay on the node (kept in the state file; reset with "
        "Kubernetes access removes them)")
    assert state_file(node.cfg.reconciler.state_dir).entries("taint") == {TAINT: "NoSchedule"}
    # nothing noted: nothing said
    notes = state_file(node.cfg.reconciler.state_dir)
    notes.forget("taint", TAINT)
    notes.forget("node_condition", "NriQosMemoryPressure")
    assert node.run(kubernetes=True) == (0, "nothing to undo\n")
