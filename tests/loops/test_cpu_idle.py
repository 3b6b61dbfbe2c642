"""Idle CPU priority for the reclaimed tier: cpu.idle set on kubelet's BestEffort tier (v1 and
v2, both drivers), its value before noted and written back when the cause goes (switched off,
observe mode, the agent stopping, a state file left by a run that died); nothing on a kernel
without the file."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from nri_plugin.report.features import evaluate, kubernetes_feature
from reconciler.host.cgroups import layout_for
from reconciler.host.probe import probe_host
from reconciler.host.statefile import StateFile, state_file
from reconciler.host.sysfs import SysFs
from reconciler.loops.cpu_idle import NOTES, CpuIdleLoop
from reconciler.runner import restore_host
from tests.support.fakesys import READ_ONLY_NUMBER, FakeHost, refuse_writes

LAYOUTS = [(1, "cgroupfs"), (1, "systemd"), (2, "cgroupfs"), (2, "systemd")]


def config(enabled: bool = True) -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, cpu_idle=dataclasses.replace(cfg.cpu_idle, enabled=enabled))


def idle_file(host: FakeHost) -> Path:
    return host.tier_dir("besteffort", "cpu") / "cpu.idle"


def make(tmp_path: Path, version: int = 2, driver: str = "systemd", *,
         cfg: Callable[[], Config] = config, notes: StateFile | None = None,
         observing: Callable[[], bool] | None = None
         ) -> tuple[FakeHost, CpuIdleLoop, MemoryAuditSink, StateFile]:
    host = FakeHost(tmp_path, version=version, driver=driver)
    idle_file(host).write_text("0\n")
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    if observing is not None:
        sysfs = sysfs.observing(observing)
    notes = notes if notes is not None else StateFile(None)
    return host, CpuIdleLoop(cfg, sysfs, layout_for(sysfs), notes), sink, notes


@pytest.mark.parametrize(("version", "driver"), LAYOUTS)
def test_the_tier_is_set_idle_and_given_back_when_the_agent_stops(
        tmp_path: Path, version: int, driver: str) -> None:
    host, loop, sink, notes = make(tmp_path, version, driver)
    loop.cycle(0.0)
    assert idle_file(host).read_text().strip() == "1"
    assert notes.entries(NOTES) == {f"/{idle_file(host).relative_to(tmp_path)}": "0"}
    assert [r["path"] for r in sink.named("cgroup_write")] == [
        f"/{idle_file(host).relative_to(tmp_path)}"]
    loop.cycle(1.0)  # already so: no second write
    assert len(sink.named("cgroup_write")) == 1
    loop.close()
    assert idle_file(host).read_text().strip() == "0"
    assert notes.entries(NOTES) == {}


def test_off_by_default_writes_nothing(tmp_path: Path) -> None:
    host, loop, sink, notes = make(tmp_path, cfg=Config)
    loop.cycle(0.0)
    loop.close()
    assert idle_file(host).read_text() == "0\n"
    assert sink.records == []
    assert notes.entries(NOTES) == {}


def test_switched_off_by_a_reload_the_tier_gets_its_value_back(tmp_path: Path) -> None:
    current = [config()]
    host, loop, _, notes = make(tmp_path, cfg=lambda: current[0])
    loop.cycle(0.0)
    assert idle_file(host).read_text().strip() == "1"
    current[0] = config(enabled=False)
    loop.cycle(1.0)
    assert idle_file(host).read_text().strip() == "0"
    assert notes.entries(NOTES) == {}
    cfg = Config()
    current[0] = dataclasses.replace(cfg, cpu_idle=dataclasses.replace(cfg.cpu_idle,
                                                                         enabled=True),
                                     reconciler=dataclasses.replace(cfg.reconciler,
                                                                    enabled=False))
    loop.cycle(2.0)  # the reconciler off: the feature with it
    assert idle_file(host).read_text().strip() == "0"


def test_observe_mode_holds_the_write_and_gives_back_an_enforcing_runs(tmp_path: Path) -> None:
    observing = [True]
    host, loop, sink, _ = make(tmp_path, observing=lambda: observing[0])
    loop.cycle(0.0)
    assert idle_file(host).read_text().strip() == "0"
    assert sink.named("write_observed")
    observing[0] = False
    loop.cycle(1.0)
    assert idle_file(host).read_text().strip() == "1"
    observing[0] = True
    loop.cycle(2.0)
    assert idle_file(host).read_text().strip() == "0"


def test_the_value_before_is_kept_when_the_tier_was_idle_already(tmp_path: Path) -> None:
    host, loop, sink, _ = make(tmp_path)
    idle_file(host).write_text("1\n")  # someone else's choice: left as it was found
    loop.cycle(0.0)
    assert sink.named("cgroup_write") == []
    loop.close()
    assert idle_file(host).read_text().strip() == "1"


def test_a_tier_made_anew_is_set_again_and_the_first_value_kept(tmp_path: Path) -> None:
    host, loop, _, notes = make(tmp_path)
    loop.cycle(0.0)
    idle_file(host).write_text("0\n")  # kubelet restarted and made the tier cgroup again
    loop.cycle(1.0)
    assert idle_file(host).read_text().strip() == "1"
    assert list(notes.entries(NOTES).values()) == ["0"]


def test_a_kernel_without_cpu_idle_gets_one_warning_and_no_write(tmp_path: Path) -> None:
    host, loop, sink, notes = make(tmp_path)
    idle_file(host).unlink()
    with capture_logs() as logs:
        loop.cycle(0.0)
        loop.cycle(1.0)
    assert [e["event"] for e in logs] == ["cpu_idle_unavailable"]
    assert sink.records == []
    assert notes.entries(NOTES) == {}


def test_a_run_that_died_is_undone_from_its_state_file(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    host, loop, _, _ = make(tmp_path / "host", notes=state_file(state))
    loop.cycle(0.0)  # ... and the agent is killed: no close
    assert idle_file(host).read_text().strip() == "1"
    restore_host(SysFs(host.root, AuditLog(MemoryAuditSink())), state_file(state), "restart")
    assert idle_file(host).read_text().strip() == "0"
    assert state_file(state).entries(NOTES) == {}


def test_a_full_state_file_means_no_write(tmp_path: Path) -> None:
    class Full(StateFile):
        def remember(self, section: str, key: str, value: str) -> bool:
            return False

    host, loop, sink, _ = make(tmp_path, notes=Full(None))
    loop.cycle(0.0)
    assert idle_file(host).read_text().strip() == "0"
    assert sink.named("cgroup_write") == []


def test_probe_says_whether_it_runs_and_why_not(tmp_path: Path) -> None:
    host, _, _, _ = make(tmp_path)
    sysfs = SysFs(tmp_path, AuditLog(MemoryAuditSink()))

    def found(cfg: Config) -> tuple[bool, str]:
        feature = evaluate(cfg, probe_host(sysfs), kubernetes_feature(cfg, None, ""))[
            "reconciler.cpu_idle"]
        return feature.runs, feature.detail

    assert found(Config()) == (
        False, "idle CPU for the reclaimed tier is switched off in the configuration")
    assert found(config()) == (True, "cpu.idle = 1 on the BestEffort tier: offline tasks run "
                                     "on CPU time nothing else wants")
    idle_file(host).unlink()
    assert found(config()) == (
        False, "the BestEffort tier's cgroup has no cpu.idle (a kernel before 5.15, the cpu "
               "controller not enabled there, or no tier yet)")


@pytest.mark.skipif(not READ_ONLY_NUMBER.exists(), reason=f"no {READ_ONLY_NUMBER} here")
def test_a_refused_write_is_audited_once_and_tried_again_each_cycle(tmp_path: Path) -> None:
    host, loop, sink, _ = make(tmp_path)
    refuse_writes(idle_file(host))
    loop.cycle(0.0)
    loop.cycle(10.0)
    path = f"/{idle_file(host).relative_to(tmp_path)}"
    # the same refusal again: said when it started, not at every cycle
    assert [r["path"] for r in sink.named("cgroup_write_failed")] == [path]
    idle_file(host).unlink()  # the kernel takes the value again
    idle_file(host).write_text("0\n")
    loop.cycle(20.0)
    assert idle_file(host).read_text().strip() == "1"
