"""``nri-qos probe`` on detection and the ladder: whether each runs on a host, and why not;
the configuration pieces detection relies on (validated thresholds, the annotation kept)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import PodMeta
from common.state import NodeState
from hooks.levels import LEVEL_NAMES
from hooks.memory_qos import VOLCANO_ANNOTATION, MemoryLevel
from hooks.model import ContainerInfo, PodInfo, RuntimeInfo
from hooks.oci_hooks import OciHook, OciHooksConfig, OciLevelHooks
from nri_plugin.capabilities import build_capabilities
from nri_plugin.capabilities.memory_qos import MemoryQosCapability
from nri_plugin.cli.probe import report
from nri_plugin.config.loader import ConfigError, parse_toml
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import ContainerEvent
from reconciler.host.probe import HostInfo, probe_host
from reconciler.host.sysfs import SysFs
from tests.support.fake_apiserver import write_kubeconfig
from tests.support.fakesys import GIB, FakeHost


def host_of(root: Path, version: int, *, reclaim: bool = True,
            pressure_level: bool = True, refaults: bool = False) -> HostInfo:
    host = FakeHost(root, version=version, driver="systemd" if version == 2 else "cgroupfs")
    host.set_numa([(40 * GIB, 64 * GIB, 1000), (40 * GIB, 64 * GIB, 1000)])
    (root / "proc/pressure").mkdir(parents=True, exist_ok=True)
    (root / "proc/pressure/memory").write_text("some avg10=0 avg60=0 avg300=0 total=0\n")
    tier = host.tier_dir("guaranteed")
    if version == 2 and reclaim:
        (tier / "memory.reclaim").write_text("")
    if version == 1:
        (tier / "memory.force_empty").write_text("")
        if pressure_level:
            (root / "sys/fs/cgroup/memory/memory.pressure_level").write_text("")
    if refaults:
        prefix = "" if version == 2 else "total_"
        (tier / "memory.stat").write_text(f"{prefix}workingset_refault_anon 0\n"
                                          f"{prefix}workingset_refault_file 7\n")
    return probe_host(SysFs(root, AuditLog(MemoryAuditSink())))


def features(cfg: Config, host: HostInfo) -> dict[str, Any]:
    found: dict[str, Any] = report(cfg, host)["features"]
    return {k: (v["runs"], v["detail"]) for k, v in found.items()
            if k.startswith(("detection.", "mitigation."))}


def test_every_detector_and_rung_is_reported(tmp_path: Path) -> None:
    found = features(Config(), host_of(tmp_path, 1))
    assert sorted(found) == sorted(
        [f"detection.{d}" for d in ("system_free", "numa_free", "psi", "pressure_level",
                                    "kswapd", "refault", "rss_overuse", "fulfillment")]
        + [f"mitigation.{r}" for r in ("taint", "tune", "drop_cache", "evict")])


def test_a_cgroup_v1_host(tmp_path: Path) -> None:
    found = features(Config(), host_of(tmp_path, 1))
    assert found["detection.pressure_level"][0] is True
    runs, detail = found["detection.numa_free"]
    assert runs
    assert detail.startswith("free memory of 2 NUMA node(s) vs their watermarks; ")
    assert found["mitigation.drop_cache"][0] is True
    assert "memory.force_empty" in found["mitigation.drop_cache"][1]
    assert "memory limit" in found["mitigation.tune"][1]
    assert found["mitigation.evict"][1].startswith("dry-run")


def test_the_taint_rung_needs_api_access(tmp_path: Path) -> None:
    cfg = Config()
    host = host_of(tmp_path, 1)
    off = dataclasses.replace(cfg, kubernetes=dataclasses.replace(cfg.kubernetes, enabled=False))
    assert features(off, host)["mitigation.taint"] == (
        False, "no Kubernetes API (kubernetes.enabled is false: NRI data only): audited as "
               "skipped")
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:1")
    on = dataclasses.replace(cfg, kubernetes=dataclasses.replace(cfg.kubernetes,
                                                                 kubeconfig=str(kubeconfig)))
    assert features(on, host)["mitigation.taint"] == (
        True, "taint nri-qos.io/memory-pressure:NoSchedule and condition NriQosMemoryPressure "
              "from level low")


def test_a_cgroup_v2_host_without_memory_reclaim(tmp_path: Path) -> None:
    found = features(Config(), host_of(tmp_path, 2, reclaim=False))
    assert found["detection.pressure_level"] == (
        False, "cgroup v2 has no memory.pressure_level (PSI serves instead)")
    assert found["mitigation.drop_cache"] == (
        False, "the kernel has no memory.reclaim (Linux 5.19+)")
    assert "each online pod's memory.pressure" in found["detection.psi"][1]
    assert "memory.high" in found["mitigation.tune"][1]


def test_psi_path_follows_the_accepted_trigger_window(tmp_path: Path) -> None:
    host = host_of(tmp_path, 1)
    slow = dataclasses.replace(host, psi=dataclasses.replace(host.psi, system=dataclasses.replace(
        host.psi.system, window_us=2_000_000)))
    runs, detail = features(Config(), slow)["detection.psi"]
    assert runs
    assert detail.startswith("the stall counter of /proc/pressure/memory every 100 ms")
    assert "2000 ms" in detail
    fast = dataclasses.replace(host, psi=dataclasses.replace(host.psi, system=dataclasses.replace(
        host.psi.system, window_us=500_000)))
    assert features(Config(), fast)["detection.psi"][1].startswith("a trigger of 500 ms")
    none = dataclasses.replace(host, psi=dataclasses.replace(host.psi, readable=False))
    assert features(Config(), none)["detection.psi"][0] is False


def test_whether_the_node_wide_detectors_drive_the_ladder_is_reported(tmp_path: Path) -> None:
    found = features(Config(), host_of(tmp_path / "v1", 1))
    assert found["detection.psi"][1].endswith(
        "; the node's reading is reported but does not drive the ladder "
        "(mitigation.node_signals auto: memory.pressure_level tells what online pods feel from "
        "the offline tier's own reclaim)")
    v2 = features(Config(), host_of(tmp_path / "v2", 2))
    for name, what in (("psi", "the node"), ("system_free", "the node"), ("kswapd", "kswapd")):
        assert v2[f"detection.{name}"][1].endswith(
            f"; {what}'s reading is reported but does not drive the ladder "
            "(mitigation.node_signals auto: the online pods' own PSI tells what online pods "
            "feel from the offline tier's own reclaim)"), name
    bare = features(Config(), host_of(tmp_path / "bare", 1, pressure_level=False))
    assert not any("drive the ladder" in detail for _, detail in bare.values())
    host = host_of(tmp_path / "nopsi", 2)
    no_psi = features(Config(), dataclasses.replace(host, psi=dataclasses.replace(
        host.psi, readable=False)))
    assert not any("drive the ladder" in detail for _, detail in no_psi.values())


def test_where_the_online_pods_refaults_are_read_they_drive_instead_of_memcg_events(
        tmp_path: Path) -> None:
    v1 = features(Config(), host_of(tmp_path / "v1", 1, refaults=True))
    assert v1["detection.refault"] == (
        True, "each online pod's working-set refaults per second from its memory.stat, over "
              "10 s")
    assert v1["detection.pressure_level"] == (
        True, "eventfds on the root memcg and kubelet's pods and burstable cgroups (local); "
              "reported and waking the detectors, but not driving the ladder "
              "(mitigation.node_signals auto: the online pods' own refaults tell whether the "
              "reclaim took online pods' memory)")
    assert v1["detection.psi"][1].endswith(
        "(mitigation.node_signals auto: the online pods' own refaults tell what online pods "
        "feel from the offline tier's own reclaim)")
    old = features(Config(), host_of(tmp_path / "old", 1))
    assert old["detection.refault"] == (
        False, "memory.stat has no workingset_refault counters (Linux 5.9+)")
    assert old["detection.pressure_level"][1].endswith("(local)")
    v2 = features(Config(), host_of(tmp_path / "v2", 2, refaults=True))
    assert v2["detection.refault"] == (
        False, "each online pod's PSI counts its stalls on refaults (cgroup v2)")


def test_switches_are_reported(tmp_path: Path) -> None:
    cfg = Config()
    cfg = dataclasses.replace(
        cfg, detection=dataclasses.replace(cfg.detection, disabled=("kswapd",)),
        mitigation=dataclasses.replace(cfg.mitigation, drop_cache=dataclasses.replace(
            cfg.mitigation.drop_cache, enabled=False)))
    found = features(cfg, host_of(tmp_path, 1, pressure_level=False))
    assert found["detection.kswapd"] == (False, "kswapd is in detection.disabled")
    assert found["mitigation.drop_cache"] == (False, "mitigation.drop_cache is switched off")
    assert found["detection.pressure_level"] == (
        False, "the memory controller has no memory.pressure_level")
    off = dataclasses.replace(cfg, detection=dataclasses.replace(cfg.detection, enabled=False))
    assert features(off, host_of(tmp_path / "b", 1))["detection.psi"] == (
        False, "detection.enabled is false")


def test_memory_qos_runs_exactly_when_its_capability_answers(tmp_path: Path) -> None:
    host = host_of(tmp_path, 2)
    cfg = Config()
    idle = dataclasses.replace(cfg, memory=dataclasses.replace(
        cfg.memory, volcano_annotation=False,
        levels={name: MemoryLevel() for name in cfg.memory.levels}))
    annotated = dataclasses.replace(idle, memory=dataclasses.replace(
        idle.memory, volcano_annotation=True))
    for config, runs in ((cfg, True), (idle, False), (annotated, True)):
        found = report(config, host)["features"]["memory_qos"]
        built = build_capabilities(config, resctrl=None, state=NodeState(),
                                   audit=AuditLog(MemoryAuditSink()), cgroup_v2=True,
                                   memory_total=64 * GIB)
        (memory,) = [c for c in built if isinstance(c, MemoryQosCapability)]
        container = ContainerInfo("c", "s", "n", memory_limit=GIB, memory_request=GIB // 2)
        events = [ContainerEvent(PodInfo("s", "u", "p", "ns", annotations={
            VOLCANO_ANNOTATION: '{"memoryQos":{"highRatio":90}}'}), container, level,
            RuntimeInfo(cgroup_v2=True)) for level in LEVEL_NAMES]
        assert found["runs"] is runs
        assert any(not memory.create_container(e).is_empty() for e in events) is runs
    assert report(idle, host)["features"]["memory_qos"]["detail"] == (
        "every level's policy is none and memory.volcano_annotation is false: nothing to set")


def test_oci_hooks_run_for_the_levels_that_have_hooks(tmp_path: Path) -> None:
    host = host_of(tmp_path, 2)
    assert report(Config(), host)["features"]["oci_hooks"] == {
        "runs": False, "detail": "no hooks configured"}
    hooks = OciHooksConfig(levels={
        "shared_cores": OciLevelHooks(poststop=(OciHook(path="/bin/true"),)),
        "dedicated_cores": OciLevelHooks(),
    })
    cfg = dataclasses.replace(Config(), oci_hooks=hooks)
    assert report(cfg, host)["features"]["oci_hooks"] == {
        "runs": True, "detail": "hooks for shared_cores"}


def test_inverted_thresholds_are_rejected_with_their_key_path() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_toml(Config, "[detection]\npsi_some_low_percent = 40.0\n")
    assert caught.value.errors == (
        "detection.psi_some_medium_percent: must be above psi_some_low_percent (40), got 30",)
    with pytest.raises(ConfigError, match=r"mitigation\.taint\.level: must be one of low"):
        parse_toml(Config, "[mitigation.taint]\nlevel = \"extreme\"\n")


def test_the_pod_watch_keeps_the_rss_overuse_annotation() -> None:
    meta = PodMeta("u", "ns", "p", {"nri-qos.io/rss-overuse-factor": "1.01", "other": "x"},
                   {}, None, {}, {})
    assert meta.trimmed(Config().read_keys()).annotations == {
        "nri-qos.io/rss-overuse-factor": "1.01"}
    cfg = Config()
    custom = dataclasses.replace(cfg, detection=dataclasses.replace(
        cfg.detection, rss_overuse_annotation="other"))
    assert meta.trimmed(custom.read_keys()).annotations == {"other": "x"}


def test_numa_balance_runs_on_cgroup_v2_only_and_says_its_bounds(tmp_path: Path) -> None:
    def balance(cfg: Config, host: HostInfo) -> tuple[bool, str]:
        found = report(cfg, host)["features"]["reconciler.numa_balance"]
        return found["runs"], found["detail"]

    v2 = host_of(tmp_path / "v2", 2)
    assert balance(Config(), v2) == (
        True, "moves reclaimed pods' pages off a node under its watermark; steps of at most "
              "64.0 MiB, killed after 5 s, at most 128.0 MiB/s")
    cfg = Config()
    dry = dataclasses.replace(cfg, numa_balance=dataclasses.replace(cfg.numa_balance,
                                                                    dry_run=True))
    assert balance(dry, v2)[1].startswith("dry-run: decides and audits steps, moves nothing")
    off = dataclasses.replace(cfg, numa_balance=dataclasses.replace(cfg.numa_balance,
                                                                    enabled=False))
    assert balance(off, v2) == (False, "NUMA balance is switched off in the configuration")
    assert balance(Config(), host_of(tmp_path / "v1", 1)) == (
        False, "cgroup v1 is not supported: there a binding's change moves the pages "
               "(cpuset.memory_migrate) in one go")
