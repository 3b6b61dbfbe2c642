"""The capabilities: wiring, events, resctrl groups over a fake tree, strictness."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.errors import InvalidInput
from hooks.events import Event
from hooks.memory_qos import VOLCANO_ANNOTATION
from hooks.model import ContainerInfo, PodInfo, RuntimeInfo
from hooks.oci_hooks import OciHook, OciHooksConfig, OciLevelHooks
from hooks.resctrl import ResctrlInfo
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION, PodPlan, plan_pod_group
from hooks.resctrl_config import ResctrlConfig
from hooks.resctrl_groups import plan_class_groups
from hooks.settings import HookStage, OciHookSpec
from nri_plugin.capabilities import build_capabilities
from nri_plugin.capabilities import resctrl as resctrl_capability
from nri_plugin.capabilities.resctrl import MAX_PLANS_KEPT, ResctrlCapability
from nri_plugin.config.loader import parse_toml
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability, ContainerEvent, PodEvent
from reconciler.host.cgroups import detect_version
from reconciler.host.resctrlfs import ResctrlFs
from reconciler.host.sysfs import SysFs
from tests.support.builders import UID, hook_executable, pod
from tests.support.resctrl_trees import intel_tree

POD_GROUP = f"nriqos-pod-{UID}"
RECORDED = '{"LLC":{"schemata":{"range":[20,80]}},"MB":{"schemata":{"percent":20}}}'
RUNTIME = RuntimeInfo(name="containerd", version="2.4.0", nri_version=(0, 12, 2), cgroup_v2=True)
MI = 1 << 20


class World:
    def __init__(self, tmp_path: Path, toml: str = "", *, num_closids: int = 16) -> None:
        self.root = intel_tree(tmp_path / "resctrl", num_closids=num_closids)
        self.config = parse_toml(Config, f'[resctrl]\nroot = "{self.root}"\n' + toml)
        self.sink = MemoryAuditSink()
        self.audit = AuditLog(self.sink)
        self.warnings: list[str] = []
        fs = ResctrlFs.detect(SysFs("/", self.audit), str(self.root),
                              prefix=self.config.resctrl.group_prefix, audit=self.audit,
                              amd_mb_max=2048, warn=self.warnings.append)
        assert fs is not None
        self.fs = fs
        self.state = NodeState()

    def capabilities(self, *, cgroup_v2: bool = True) -> list[Capability]:
        return build_capabilities(self.config, resctrl=self.fs, state=self.state,
                                  audit=self.audit, cgroup_v2=cgroup_v2, memory_total=0)

    def setup(self) -> set[str]:
        plan = plan_class_groups(self.config.resctrl, self.fs.info, self.fs.our_groups())
        return self.fs.apply_class_groups(plan, reason="config", warn=self.warnings.append)

    def resctrl(self) -> ResctrlCapability:
        capability = self.capabilities()[0]
        assert isinstance(capability, ResctrlCapability)
        return capability


def ctr(limit: int | None = 512 * MI) -> ContainerInfo:
    return ContainerInfo(id="c1", pod_sandbox_id="sb", name="app", memory_limit=limit,
                         memory_request=128 * MI, oom_score_adj=-997)


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# --- wiring ----------------------------------------------------------------------------------

def test_default_chain_and_events(world: World) -> None:
    capabilities = world.capabilities()
    assert [h.name for h in capabilities] == ["resctrl", "memory_qos", "oom_score", "oci_hooks"]
    assert capabilities[0].events == {Event.RUN_POD_SANDBOX, Event.CREATE_CONTAINER,
                               Event.REMOVE_POD_SANDBOX}
    assert all(h.events == {Event.CREATE_CONTAINER} for h in capabilities[1:])


def test_without_resctrl_no_resctrl_capability(world: World) -> None:
    capabilities = build_capabilities(world.config, resctrl=None, state=world.state,
                                      audit=world.audit, cgroup_v2=True, memory_total=0)
    assert [h.name for h in capabilities] == ["memory_qos", "oom_score", "oci_hooks"]


SWITCHED_OFF = "[memory]\nenabled = false\n[oom]\nenabled = false\n"


def answers(capabilities: list[Capability]) -> list[str]:
    """The capabilities that set something for a reclaimed_cores container whose pod has the
    Volcano annotation (the level that :func:`with_hooks` gives an OCI hook)."""
    event = ContainerEvent(pod({VOLCANO_ANNOTATION: '{"memoryQos":{"highRatio":90}}'}), ctr(),
                           "reclaimed_cores", RUNTIME)
    return [h.name for h in capabilities
            if h.name != "resctrl" and not h.create_container(event).is_empty()]


def with_hooks(cfg: Config, tool: Path) -> Config:
    return dataclasses.replace(cfg, oci_hooks=OciHooksConfig(levels={
        "reclaimed_cores": OciLevelHooks(prestart=(OciHook(path=str(tool)),))}))


def test_switched_off_capabilities_answer_nothing(tmp_path: Path) -> None:
    # resctrl needs its filesystem, opened at start: not built when off at start.
    w = World(tmp_path, "enabled = false\n" + SWITCHED_OFF)
    capabilities = w.capabilities()
    assert [h.name for h in capabilities] == ["memory_qos", "oom_score", "oci_hooks"]
    assert answers(capabilities) == []


def test_memory_capability_answers_nothing_when_nothing_to_do(tmp_path: Path) -> None:
    w = World(tmp_path, "[memory]\nvolcano_annotation = false\n" + "".join(
        f"[memory.levels.{level}]\npolicy = \"none\"\n"
        for level in ("reclaimed_cores", "shared_cores", "dedicated_cores")))
    assert "memory_qos" not in answers(w.capabilities())


def test_a_reload_switches_memory_qos_oom_score_and_oci_hooks_off_and_on(
        tmp_path: Path) -> None:
    tool = hook_executable(tmp_path / "tool")
    on = World(tmp_path / "on")
    off = World(tmp_path / "off", SWITCHED_OFF)
    capabilities = on.capabilities()
    capabilities[-1].reconfigure(with_hooks(on.config, tool))
    assert answers(capabilities) == ["memory_qos", "oom_score", "oci_hooks"]
    for capability in capabilities:
        capability.reconfigure(off.config)
    assert answers(capabilities) == []
    # Off at start, on at a reload.
    capabilities = off.capabilities()
    for capability in capabilities:
        capability.reconfigure(with_hooks(on.config, tool))
    assert answers(capabilities) == ["memory_qos", "oom_score", "oci_hooks"]


def test_oci_hooks_capability_only_with_configured_hooks(tmp_path: Path) -> None:
    tool = hook_executable(tmp_path / "tool")
    w = World(tmp_path, f'[[oci_hooks.levels.reclaimed_cores.prestart]]\npath = "{tool}"\n')
    capabilities = w.capabilities()
    assert capabilities[-1].name == "oci_hooks"
    settings = capabilities[-1].create_container(
        ContainerEvent(pod({"x": "y"}), ctr(), "reclaimed_cores", RUNTIME))
    assert settings.hooks == (OciHookSpec(HookStage.PRESTART, str(tool)),)
    assert capabilities[-1].create_container(
        ContainerEvent(pod(), ctr(), "shared_cores", RUNTIME)).is_empty()


@pytest.mark.parametrize(("setting", "detected", "v2"), [
    ("auto", True, True), ("auto", False, False), ("v1", True, False), ("v2", False, True)])
def test_cgroup_version_override(tmp_path: Path, setting: str, detected: bool, v2: bool) -> None:
    w = World(tmp_path, f'[memory]\ncgroup_version = "{setting}"\n')
    host = tmp_path / "host"
    (host / "sys/fs/cgroup").mkdir(parents=True)
    if detected:
        (host / "sys/fs/cgroup/cgroup.controllers").write_text("memory\n")
    assert (detect_version(SysFs(host), w.config.memory.cgroup_version) == 2) is v2
    mem = next(h for h in w.capabilities(cgroup_v2=v2) if h.name == "memory_qos")
    settings = mem.create_container(ContainerEvent(pod(), ctr(), "reclaimed_cores", RUNTIME))
    assert bool(settings.unified) is v2


# --- class groups ----------------------------------------------------------------------------

def test_setup_class_groups_and_reload(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.setup()
    assert w.fs.our_groups() == ["nriqos-dedicated_cores", "nriqos-reclaimed_cores",
                                 "nriqos-shared_cores", "nriqos-system_cores"]
    assert (w.root / "nriqos-reclaimed_cores" / "schemata").read_text() == (
        "L3:0=f;1=f\nMB:0=100;1=100\n")
    created = len(w.sink.named("resctrl_group_created"))
    w.setup()   # unchanged config: no writes
    assert len(w.sink.named("resctrl_group_created")) == created
    reloaded = World.__new__(World)
    reloaded.__dict__.update(w.__dict__)
    reloaded.config = parse_toml(
        Config, f'[resctrl]\nroot = "{w.root}"\n[resctrl.levels.system_cores]\nenabled = false\n'
                '[resctrl.levels.reclaimed_cores]\nl3_end_percent = 50\nmb_percent = 40\n')
    reloaded.setup()
    assert "nriqos-system_cores" not in w.fs.our_groups()
    assert (w.root / "nriqos-reclaimed_cores" / "schemata").read_text() == (
        "L3:0=3f;1=3f\nMB:0=40;1=40\n")
    assert w.sink.named("resctrl_group_removed") == [
        {"group": "nriqos-system_cores", "reason": "level system_cores disabled"}]


def test_class_groups_that_do_not_fit_are_skipped(tmp_path: Path) -> None:
    w = World(tmp_path)
    # A file in the way stands in for any kernel refusal.
    (w.root / "nriqos-shared_cores").write_text("")
    groups = w.setup()
    assert "nriqos-shared_cores" not in groups
    assert len(groups) == 3
    assert len(w.warnings) == 1
    assert "nriqos-shared_cores" in w.warnings[0]


# --- resctrl capability ----------------------------------------------------------------------

def test_container_goes_to_its_level_class_group(world: World) -> None:
    world.setup()
    capability = world.resctrl()
    for level in ("reclaimed_cores", "shared_cores"):
        settings = capability.create_container(ContainerEvent(pod(), ctr(), level, RUNTIME))
        assert settings.rdt_class == f"nriqos-{level}"
        assert settings.hooks == ()


def test_missing_class_group_emits_no_clos(world: World) -> None:
    capability = world.resctrl()
    assert capability.create_container(
        ContainerEvent(pod(), ctr(), "shared_cores", RUNTIME)).is_empty()
    assert "class group of shared_cores is missing" in (
        world.sink.named("adjustment_skipped")[0]["reason"])


def test_pod_group_lifecycle(world: World) -> None:
    world.setup()
    capability = world.resctrl()
    p = pod({KOORDINATOR_ANNOTATION: RECORDED})
    capability.run_pod_sandbox(PodEvent(p, "shared_cores", RUNTIME))
    assert (world.root / POD_GROUP / "schemata").read_text() == "L3:0=1fc;1=1fc\nMB:0=20;1=20\n"
    assert (world.root / POD_GROUP / "mon_groups" / POD_GROUP).is_dir()
    settings = capability.create_container(ContainerEvent(p, ctr(), "shared_cores", RUNTIME))
    assert settings.rdt_class == POD_GROUP
    assert settings.hooks == ()   # monitor hook is off by default
    # After a plugin restart the group on disk is found again.
    fresh = world.resctrl()
    assert fresh.create_container(
        ContainerEvent(p, ctr(), "shared_cores", RUNTIME)).rdt_class == POD_GROUP
    capability.remove_pod_sandbox(PodEvent(p, "shared_cores", RUNTIME))
    assert not (world.root / POD_GROUP).exists()
    assert (world.root / "nriqos-shared_cores").is_dir()   # class groups are never removed
    assert capability.create_container(
        ContainerEvent(p, ctr(), "shared_cores", RUNTIME)).rdt_class == "nriqos-shared_cores"


def test_a_pods_plan_is_made_once_and_again_when_what_it_comes_from_changes(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world.setup()
    capability = world.resctrl()
    plans: list[str] = []

    def counted(pod: PodInfo, level: str, cfg: ResctrlConfig, info: ResctrlInfo) -> PodPlan:
        plans.append(pod.uid)
        return plan_pod_group(pod, level, cfg, info)

    monkeypatch.setattr(resctrl_capability, "plan_pod_group", counted)
    p = pod({KOORDINATOR_ANNOTATION: RECORDED})
    capability.run_pod_sandbox(PodEvent(p, "shared_cores", RUNTIME))
    plans.clear()

    def clos(of: PodInfo = p, level: str = "shared_cores") -> str | None:
        return capability.create_container(ContainerEvent(of, ctr(), level, RUNTIME)).rdt_class

    assert [clos(), clos()] == [POD_GROUP, POD_GROUP]
    assert len(plans) == 1
    # The annotation gone (an API update of the pod), another level, a reload: planned again.
    assert clos(dataclasses.replace(p, annotations={})) == "nriqos-shared_cores"
    assert clos(p, "dedicated_cores") == POD_GROUP
    capability.reconfigure(parse_toml(Config, f'[resctrl]\nroot = "{world.root}"\n'))
    assert clos() == POD_GROUP
    assert len(plans) == 4
    # Kept for MAX_PLANS_KEPT pods; one more and the record starts afresh.
    others = [pod(uid=f"other-{i}") for i in range(MAX_PLANS_KEPT - 1)]
    for other in others:
        clos(other)
    plans.clear()
    assert clos() == POD_GROUP
    assert plans == []
    clos(pod(uid="one-too-many"))
    assert clos() == POD_GROUP
    assert plans == ["one-too-many", UID]
    # RemovePodSandbox forgets it.
    capability.remove_pod_sandbox(PodEvent(p, "shared_cores", RUNTIME))
    plans.clear()
    assert clos() == "nriqos-shared_cores"
    assert plans == [UID]


def test_pod_group_stays_while_another_sandbox_of_the_pod_is_there(world: World) -> None:
    # kubelet replaces a pod's sandbox: it runs the new one, then removes the old one. Both carry
    # the pod's uid; the group is the pod's and goes with its last sandbox.
    world.setup()
    capability = world.resctrl()
    old = pod({KOORDINATOR_ANNOTATION: RECORDED})
    new = dataclasses.replace(old, id="sb-new")
    world.state.replace_all([old, new], [])
    for sandbox in (old, new):
        capability.run_pod_sandbox(PodEvent(sandbox, "shared_cores", RUNTIME))
    capability.remove_pod_sandbox(PodEvent(old, "shared_cores", RUNTIME))
    world.state.remove_pod(old.id, Event.REMOVE_POD_SANDBOX)
    assert (world.root / POD_GROUP / "schemata").read_text() == "L3:0=1fc;1=1fc\nMB:0=20;1=20\n"
    assert world.sink.named("resctrl_group_removed") == []
    assert capability.create_container(
        ContainerEvent(new, ctr(), "shared_cores", RUNTIME)).rdt_class == POD_GROUP
    capability.remove_pod_sandbox(PodEvent(new, "shared_cores", RUNTIME))
    assert not (world.root / POD_GROUP).exists()
    assert world.sink.named("resctrl_group_removed") == [
        {"group": POD_GROUP, "reason": f"pod {UID} removed"}]


def test_reload_switching_resctrl_off_removes_every_group_of_ours(world: World) -> None:
    world.setup()
    capability = world.resctrl()
    p = pod({KOORDINATOR_ANNOTATION: RECORDED})
    capability.run_pod_sandbox(PodEvent(p, "shared_cores", RUNTIME))
    (world.root / "COS1").mkdir()
    capability.reconfigure(parse_toml(
        Config, f'[resctrl]\nroot = "{world.root}"\nenabled = false\n'))
    assert world.fs.control_groups() == ["COS1"]
    assert sorted((r["group"], r["reason"]) for r in world.sink.named("resctrl_group_removed")) == [
        (group, "resctrl.enabled is false") for group in (
            "nriqos-dedicated_cores", POD_GROUP, "nriqos-reclaimed_cores", "nriqos-shared_cores",
            "nriqos-system_cores")]
    # While it is off no group is made, and no container is named one.
    capability.run_pod_sandbox(PodEvent(pod({KOORDINATOR_ANNOTATION: RECORDED}, uid="u2"),
                                        "shared_cores", RUNTIME))
    assert world.fs.control_groups() == ["COS1"]
    assert capability.create_container(
        ContainerEvent(p, ctr(), "shared_cores", RUNTIME)).is_empty()
    assert world.sink.named("adjustment_skipped") == []


def test_monitor_hook_injected_for_pod_groups(tmp_path: Path) -> None:
    tool = hook_executable(tmp_path / "nri-qos-hook")
    w = World(tmp_path, f'[resctrl.monitor_hook]\nenabled = true\npath = "{tool}"\n'
                        "strict = true\ntimeout_s = 3\n")
    w.setup()
    capability = w.resctrl()
    p = pod({w.config.resctrl.annotation: '{"MB":{"schemata":{"percent":50}}}'})
    capability.run_pod_sandbox(PodEvent(p, "shared_cores", RUNTIME))
    settings = capability.create_container(ContainerEvent(p, ctr(), "shared_cores", RUNTIME))
    assert settings.hooks == (OciHookSpec(
        HookStage.PRESTART, str(tool),
        ("nri-qos-hook", "resctrl-join", "--root", str(w.root), "--group", POD_GROUP,
         "--strict"), timeout_s=3),)
    # Class-group containers need no monitor hook.
    other = capability.create_container(
        ContainerEvent(pod(uid="u2"), ctr(), "shared_cores", RUNTIME))
    assert other.hooks == ()


def test_invalid_annotation_is_audited_and_class_group_used(world: World) -> None:
    world.setup()
    capability = world.resctrl()
    p = pod({KOORDINATOR_ANNOTATION: '{"LLC":{"schemata":{"range":[0,101]}}}'})
    capability.run_pod_sandbox(PodEvent(p, "shared_cores", RUNTIME))
    assert not (world.root / POD_GROUP).exists()
    skipped = world.sink.named("adjustment_skipped")
    assert skipped[0]["pod_uid"] == UID
    assert "resctrl: LLC.schemata.range[1]" in (
        skipped[0]["reason"])
    assert capability.create_container(
        ContainerEvent(p, ctr(), "shared_cores", RUNTIME)).rdt_class == "nriqos-shared_cores"


def test_strict_turns_problems_into_invalid_input(tmp_path: Path) -> None:
    w = World(tmp_path, "[plugin]\nstrict = true\n")
    w.setup()
    capability = w.resctrl()
    p = pod({KOORDINATOR_ANNOTATION: "{not json"})
    with pytest.raises(InvalidInput) as err:
        capability.run_pod_sandbox(PodEvent(p, "shared_cores", RUNTIME))
    assert err.value.capability == "resctrl"
    assert len(w.sink.named("adjustment_skipped")) == 1
    mem = next(h for h in w.capabilities() if h.name == "memory_qos")
    with pytest.raises(InvalidInput, match="memory_qos"):
        mem.create_container(ContainerEvent(pod({VOLCANO_ANNOTATION: "[]"}), ctr(),
                                            "shared_cores", RUNTIME))
    oom = next(h for h in w.capabilities() if h.name == "oom_score")
    with pytest.raises(InvalidInput, match="oom_score"):
        oom.create_container(ContainerEvent(pod({w.config.oom.annotation: "-1000"}), ctr(),
                                            "shared_cores", RUNTIME))


def test_clos_exhaustion_falls_back_to_class_group(tmp_path: Path) -> None:
    w = World(tmp_path, num_closids=6)   # root + 4 class groups + 1 pod group
    w.setup()
    capability = w.resctrl()
    shared = [pod({KOORDINATOR_ANNOTATION: RECORDED}, uid=f"sh-{i}") for i in range(2)]
    for p in shared:
        capability.run_pod_sandbox(PodEvent(p, "shared_cores", RUNTIME))
    got = [capability.create_container(ContainerEvent(p, ctr(), "shared_cores", RUNTIME))
           .rdt_class for p in shared]
    assert got == ["nriqos-pod-sh-0", "nriqos-shared_cores"]
    assert w.sink.named("resctrl_fallback") == [{
        "pod_uid": "sh-1", "group": "nriqos-shared_cores",
        "reason": "CLOS budget exhausted (6 CLOS)"}]
    # Removing the fallen-back pod never touches the class group.
    capability.remove_pod_sandbox(PodEvent(shared[1], "shared_cores", RUNTIME))
    assert (w.root / "nriqos-shared_cores").is_dir()


def test_reclaimed_pod_keeps_within_its_share(world: World) -> None:
    world.setup()
    capability = world.resctrl()
    # The recorded pod asks for L3 20..80 %: outside reclaimed's 0..30 %, so L3 stays at the
    # level's share while its MB request (20 %) is honoured.
    p = pod({KOORDINATOR_ANNOTATION: RECORDED})
    capability.run_pod_sandbox(PodEvent(p, "reclaimed_cores", RUNTIME))
    assert (world.root / POD_GROUP / "schemata").read_text() == "L3:0=f;1=f\nMB:0=20;1=20\n"
    assert "outside the allowed [0, 30]" in world.sink.named("adjustment_skipped")[0]["reason"]


def test_synchronize_learns_existing_pod_groups(world: World) -> None:
    world.setup()
    first = world.resctrl()
    p = pod({KOORDINATOR_ANNOTATION: RECORDED})
    first.run_pod_sandbox(PodEvent(p, "shared_cores", RUNTIME))
    second = world.resctrl()
    second.synchronize([p, pod(uid="other")], [])
    assert second.create_container(
        ContainerEvent(p, ctr(), "shared_cores", RUNTIME)).rdt_class == POD_GROUP


# --- memory and oom capabilities ---------------------------------------------------------------

def test_memory_and_oom_capabilities_for_reclaimed(world: World) -> None:
    capabilities = {h.name: h for h in world.capabilities()}
    ev = ContainerEvent(pod(), ctr(), "reclaimed_cores", RUNTIME)
    memory = capabilities["memory_qos"].create_container(ev)
    assert dict(memory.unified) == {"memory.high": "510025728"}
    assert capabilities["oom_score"].create_container(ev).oom_score_adj == 1000


def test_problems_audited_per_container_without_strict(world: World) -> None:
    capabilities = {h.name: h for h in world.capabilities()}
    ev = ContainerEvent(pod({world.config.oom.annotation: "abc"}), ctr(), "shared_cores", RUNTIME)
    assert capabilities["oom_score"].create_container(ev).is_empty()
    rec = world.sink.named("adjustment_skipped")[0]
    assert rec["container"] == "app"
    assert rec["reason"].startswith("oom_score: ")


def test_reconfigure_applies_a_reloaded_config_to_built_capabilities() -> None:
    import dataclasses

    from common.audit import AuditLog, MemoryAuditSink
    from hooks.config_fields import frozen_map
    from hooks.model import ContainerInfo, RuntimeInfo
    from hooks.oom_score import OomLevel
    from nri_plugin.capabilities import build_capabilities
    from nri_plugin.config.schema import Config
    from nri_plugin.session.capability import ContainerEvent

    cfg = Config()
    (oom,) = [h for h in build_capabilities(cfg, resctrl=None, state=NodeState(),
                                            audit=AuditLog(MemoryAuditSink()),
                                            cgroup_v2=False, memory_total=0)
              if h.name == "oom_score"]
    event = ContainerEvent(PodInfo("s", "u", "p", "ns"), ContainerInfo("c", "s", "n"),
                           "shared_cores", RuntimeInfo())
    assert oom.create_container(event).oom_score_adj is None
    levels = dict(cfg.oom.levels)
    levels["shared_cores"] = OomLevel(set_score=True, score=300, floor=2)
    reloaded = dataclasses.replace(cfg, oom=dataclasses.replace(cfg.oom,
                                                                levels=frozen_map(levels)))
    oom.reconfigure(reloaded)
    assert oom.create_container(event).oom_score_adj == 300


def test_reconfigure_reaches_oci_hooks() -> None:
    import dataclasses

    from hooks.config_fields import frozen_map
    from hooks.model import ContainerInfo, RuntimeInfo
    from hooks.oci_hooks import OciHook, OciLevelHooks
    from nri_plugin.capabilities.oci_hooks import OciHooksCapability
    from nri_plugin.config.schema import Config
    from nri_plugin.session.capability import ContainerEvent

    cfg = Config()
    capability = OciHooksCapability(cfg.oci_hooks)
    event = ContainerEvent(PodInfo("s", "u", "p", "ns"), ContainerInfo("c", "s", "n"),
                           "reclaimed_cores", RuntimeInfo())
    assert capability.create_container(event).hooks == ()
    level = OciLevelHooks(prestart=(OciHook(path="/bin/true", args=("true",)),))
    reloaded = dataclasses.replace(cfg, oci_hooks=dataclasses.replace(
        cfg.oci_hooks, levels=frozen_map({"reclaimed_cores": level})))
    capability.reconfigure(reloaded)
    assert [(h.stage, h.path, h.args) for h in capability.create_container(event).hooks] == [
        ("prestart", "/bin/true", ("true",))]
    other = dataclasses.replace(event, level="shared_cores")
    assert capability.create_container(other).hooks == ()
