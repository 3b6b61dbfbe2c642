"""Drift repair: memcg files and oom_score_adj follow the policies, including annotation changes
delivered by the pod watch."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import MappingProxyType

from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import PodMeta
from common.state import NodeState
from hooks.events import Event
from hooks.memory_qos import MemoryLevel
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import read_meminfo
from reconciler.host.sysfs import SysFs
from reconciler.loops.drift import DriftLoop
from tests.support.fakesys import GIB, MIB, FakeContainer, FakeHost

UID = "33333333-0000-0000-0000-000000000003"


def build(tmp_path: Path, version: int, driver: str, cfg: Config | None = None
          ) -> tuple[FakeHost, NodeState, DriftLoop, MemoryAuditSink]:
    host = FakeHost(tmp_path, version=version, driver=driver)
    host.set_numa([(8 * GIB, 16 * GIB, 100)])
    state = NodeState()
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    config = cfg or Config()
    loop = DriftLoop(lambda: config, state, sysfs, layout_for(sysfs), read_meminfo(sysfs).get(
        "MemTotal", 0))
    return host, state, loop, sink


def oom(host: FakeHost, pid: int) -> int:
    return int((host.root / "proc" / str(pid) / "oom_score_adj").read_text())


def high(host: FakeHost, c: FakeContainer) -> str:
    return (host.cg("", c.rel) / "memory.high").read_text().strip()


def writes(sink: MemoryAuditSink) -> list[str]:
    return [r["path"] for r in sink.named("cgroup_write")]


def test_v2_reclaimed_pod_that_predates_the_plugin(tmp_path: Path) -> None:
    host, state, loop, sink = build(tmp_path, 2, "systemd")
    pod = host.add_pod(UID, tier="besteffort", containers=2, memory_limit=1 * GIB)
    extra = host.add_process(pod.containers[0], threads=3)
    state.replace_all(*host.nri())
    loop.cycle(0.0)
    for c in pod.containers:
        assert high(host, c) == str(int(GIB * 0.95) // 4096 * 4096)
        assert all(oom(host, pid) == 1000 for pid in c.pids)
    assert extra[1] not in pod.containers[0].pids  # threads are not written, processes are
    assert oom(host, extra[1]) == 0
    done = len(writes(sink))
    assert done == 2 + 3  # two memory.high, three processes
    loop.cycle(10.0)
    assert len(writes(sink)) == done  # idle


def test_overwritten_values_and_new_processes_are_repaired(tmp_path: Path) -> None:
    host, state, loop, sink = build(tmp_path, 2, "systemd")
    pod = host.add_pod(UID, tier="besteffort", memory_limit=1 * GIB)
    state.replace_all(*host.nri())
    loop.cycle(0.0)
    c = pod.containers[0]
    (host.cg("", c.rel) / "memory.high").write_text("max\n")
    (host.root / "proc" / str(c.pids[0]) / "oom_score_adj").write_text("-998\n")
    [newpid] = host.add_process(c)
    before = len(writes(sink))
    loop.cycle(10.0)
    assert high(host, c) != "max"
    assert oom(host, c.pids[0]) == 1000
    assert oom(host, newpid) == 1000
    assert len(writes(sink)) == before + 3


def test_exited_process_is_not_an_error(tmp_path: Path) -> None:
    host, state, loop, sink = build(tmp_path, 1, "cgroupfs")
    pod = host.add_pod(UID, tier="besteffort")
    c = pod.containers[0]
    for f in (host.root / "proc" / str(c.pids[0])).iterdir():
        f.unlink()
    (host.root / "proc" / str(c.pids[0])).rmdir()
    state.replace_all(*host.nri())
    loop.cycle(0.0)
    assert sink.named("cgroup_write_failed") == []


def test_annotation_change_from_the_pod_watch(tmp_path: Path) -> None:
    host, state, loop, sink = build(tmp_path, 2, "systemd")
    pod = host.add_pod(UID, tier="burstable", memory_limit=512 * MIB)
    c = pod.containers[0]
    state.replace_all(*host.nri())
    loop.cycle(0.0)
    assert writes(sink) == []  # shared_cores: nothing to enforce by default
    assert high(host, c) == "max"

    def meta(annotations: dict[str, str]) -> PodMeta:
        return PodMeta(uid=UID, namespace="default", name=pod.info.name,
                       annotations=MappingProxyType(annotations),
                       labels=MappingProxyType({}), priority=0,
                       memory_requests=MappingProxyType({}),
                       memory_limits=MappingProxyType({"c0": 512 * MIB}))

    state.apply_meta(meta({"qos.nri-qos.io/oom-score-adj": "500"}))
    loop.cycle(10.0)
    assert oom(host, c.pids[0]) == 500

    state.apply_meta(meta({"qos.nri-qos.io/level": "reclaimed_cores"}))
    loop.cycle(20.0)
    assert oom(host, c.pids[0]) == 1000
    assert high(host, c) == str(int(512 * MIB * 0.95) // 4096 * 4096)

    # a value below the level's floor is refused: the level's score stays
    state.apply_meta(meta({"qos.nri-qos.io/level": "reclaimed_cores",
                           "qos.nri-qos.io/oom-score-adj": "-500"}))
    loop.cycle(30.0)
    assert oom(host, c.pids[0]) == 1000


def test_v1_reservation_from_requests_known_through_the_api(tmp_path: Path) -> None:
    base = Config()
    levels = dict(base.memory.levels)
    levels["shared_cores"] = MemoryLevel(policy="ratios", low_ratio=50, v1_reservation=True)
    cfg = dataclasses.replace(base, memory=dataclasses.replace(
        base.memory, levels=MappingProxyType(levels)))
    host, state, loop, _ = build(tmp_path, 1, "cgroupfs", cfg)
    pod = host.add_pod(UID, tier="burstable")
    state.replace_all(*host.nri())
    loop.cycle(0.0)
    soft = host.cg("memory", pod.containers[0].rel) / "memory.soft_limit_in_bytes"
    assert soft.read_text().strip() == "9223372036854771712"  # no request known yet
    state.apply_meta(PodMeta(uid=UID, namespace="default", name="p", annotations={}, labels={},
                             priority=None,
                             memory_requests={"c0": 256 * MIB}, memory_limits={}))
    loop.cycle(10.0)
    assert soft.read_text() == str(128 * MIB)


def test_stopped_containers_are_left_alone(tmp_path: Path) -> None:
    host, state, loop, sink = build(tmp_path, 1, "cgroupfs")
    pod = host.add_pod(UID, tier="besteffort")
    state.pod_view(pod.info.id, lambda: pod.info)
    state.put_container(pod.info.id, pod.containers[0].info, Event.STOP_CONTAINER, running=False)
    assert state.snapshot().containers  # known, but not running
    loop.cycle(0.0)
    assert sink.records == []


def test_one_broken_container_does_not_stop_the_others(tmp_path: Path) -> None:
    host, state, loop, _ = build(tmp_path, 2, "systemd")
    pod = host.add_pod(UID, tier="besteffort", containers=2, memory_limit=1 * GIB)
    broken, healthy = pod.containers
    # A container whose memory.high cannot be read or written as a file.
    high_file = host.cg("", broken.rel) / "memory.high"
    high_file.unlink()
    high_file.mkdir()
    # And one whose cgroups path the sysfs layer would refuse (a dot-leading component).
    odd = dataclasses.replace(healthy.info, id="odd", cgroups_path=healthy.info.cgroups_path
                              .replace(":cri-containerd:", ":cri-containerd:."))
    pods, containers = host.nri()
    state.replace_all(pods, [*containers, odd])
    loop.cycle(0.0)
    assert high(host, healthy) == str(int(GIB * 0.95) // 4096 * 4096)
    assert all(oom(host, pid) == 1000 for pid in healthy.pids)


def test_an_unusable_cgroups_path_is_said_once_while_its_container_runs(tmp_path: Path) -> None:
    host, state, loop, _ = build(tmp_path, 2, "systemd")
    pod = host.add_pod(UID, tier="besteffort")
    odd = dataclasses.replace(pod.containers[0].info, cgroups_path="not-a-cgroups-path")
    with capture_logs() as logs:
        state.replace_all([pod.info], [odd])
        loop.cycle(0.0)
        # a new snapshot, the container still runs
        state.put_container(pod.info.id, odd, Event.UPDATE_CONTAINER)
        loop.cycle(1.0)
        # Gone, then back (a new container with the same id): said again, nothing was kept.
        state.replace_all([pod.info], [])
        loop.cycle(2.0)
        state.replace_all([pod.info], [odd])
        loop.cycle(3.0)
    skipped = [e for e in logs if e["event"] == "container_skipped"]
    assert [e["container"] for e in skipped] == [odd.id, odd.id]
