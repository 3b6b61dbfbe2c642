"""Observe mode over weeks on a busy node: each held write is audited once per file and value,
the files of containers long gone do not crowd out those of the containers still running (whose
writes would otherwise all be audited again, at once), and the task moves into a resctrl group,
whose ids change with every process the containers start, are audited once per group."""

from __future__ import annotations

from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.levels import LEVEL_NAMES
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.resctrlfs import ResctrlFs, read_info
from reconciler.host.sysfs import SysFs
from reconciler.loops.resctrl_tasks import ResctrlTasksLoop
from tests.support.drift_cycles import Drift
from tests.support.fakesys import MIB, FakeHost, FakePod

STEADY = "5eadd000-0000-4000-8000-000000000001"
CHURNED_PODS = 3000
BATCH = 500


def uid(n: int) -> str:
    return f"c0c0{n:04x}-0000-4000-8000-{n:012x}"


def test_held_writes_of_running_containers_are_audited_once_while_other_pods_churn(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=2, driver="systemd")
    steady = host.add_pod(STEADY, tier="burstable", memory_request=256 * MIB,
                          memory_limit=512 * MIB)
    state = NodeState()
    sink = MemoryAuditSink()
    config = Config()
    drift = Drift(tmp_path, state, lambda: config, AuditLog(sink), observe=lambda: True)

    def cycle() -> None:
        state.replace_all(*host.nri())
        drift.cycle()

    cycle()
    steady_low = str(host.cg("memory", steady.containers[0].rel) / "memory.low")
    steady_low = steady_low.removeprefix(str(tmp_path))

    def audited(path: str) -> int:
        return sum(1 for r in sink.named("write_observed") if r["path"] == path)

    assert audited(steady_low) == 1
    # Short-lived pods (CronJobs, CI runners): each seen running by one cycle, then gone.
    for first in range(0, CHURNED_PODS, BATCH):
        batch: list[FakePod] = [
            host.add_pod(uid(n), tier="burstable", memory_request=64 * MIB, threads=1)
            for n in range(first, first + BATCH)]
        cycle()
        for pod in batch:
            host.remove_pod(pod)
        cycle()
    assert len(sink.named("write_observed")) > 4096  # (the churn held that many writes)
    assert audited(steady_low) == 1


def test_task_moves_held_by_observe_mode_are_audited_once_per_group_as_processes_start(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    resctrl = host.make_resctrl()
    for level in LEVEL_NAMES:
        host.add_resctrl_group(f"nriqos-{level}")
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit).observing(lambda: True)
    mount = f"/{resctrl.relative_to(tmp_path)}"
    groups = ResctrlFs(sysfs, mount, read_info(sysfs, mount, 2048), prefix="nriqos-",
                       audit=audit)
    state = NodeState()
    config = Config()
    loop = ResctrlTasksLoop(lambda: config, state, sysfs, layout_for(sysfs), groups, audit)
    # Containers that ran before the agent: their tasks are in the root group, and so is every
    # process they start (a task starts in its parent's group), none being moved.
    pods = [host.add_pod(uid(n), tier="burstable") for n in range(5)]
    state.replace_all(*host.nri())
    (resctrl / "tasks").write_text("".join(f"{tid}\n" for tid in host.all_tids()))
    for second in range(60):
        for pod in pods:
            with (resctrl / "tasks").open("a") as tasks:
                tasks.writelines(f"{tid}\n" for tid in host.add_process(pod.containers[0]))
        loop.cycle(float(second))
    held = [r for r in sink.named("write_observed") if r["path"].endswith("/tasks")]
    assert [r["path"] for r in held] == ["/sys/fs/resctrl/nriqos-shared_cores/tasks"]
