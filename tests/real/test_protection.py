"""Memory protection on a real cgroup v2 kernel: a container's ``memory.min``, or the default
policy's ``memory.low``, keeps nothing while its pod and tier cgroups are at 0, and keeps its page
cache once drift gave them the sum below. A restarted agent writes back the values from before
only where the files still hold its last write.

``kubepods`` is capped (node-allocatable), an online container holds page cache under its own
protection, and an offline pod streams a file larger than ``kubepods`` over and over: the
kernel reclaims at ``kubepods``' limit, and what the online container keeps is read from its
``memory.stat``. Page cache comes from files on the guest's scratch ext4 disk.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.config_fields import frozen_map
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.loops.drift import DriftLoop
from reconciler.loops.protection import PROTECTION_NOTES, WRITTEN_NOTES, AncestorProtection
from tests.support.guest_node import CGROUP, MIB, Node, memory_stat, read_int
from tests.support.realroot import data_file

pytestmark = pytest.mark.vm(numa=2, mem_mib=1024)

ONLINE = "5e5e5e5e-0000-4000-8000-000000000001"
OFFLINE = "5e5e5e5e-0000-4000-8000-000000000002"
ONLINE_CID = "e" * 64
KUBEPODS_MIB = 384
CACHE_MIB = 128
REQUEST_MIB = 160
"""The online container's request, and its memory.min (min_ratio 100): above all it holds."""
STREAM_MIB = 512
PRESSURE_S = 4
PRESSURE_MIB = 1536
"""What the offline pod streams, at least, in rounds of ``PRESSURE_S``: four times
``kubepods``, however fast the machine (a guest under TCG runs 5-30 times slower than its
host, and a fixed time of streaming presses a slow one too little)."""
PRESSURE_ROUNDS = 12


def protecting(key: str) -> Config:
    """shared_cores protecting its requests in full with ``key``: memory.low is the default
    policy's, memory.min the opt-in one's."""
    if key == "memory.low":
        return Config()
    memory = Config().memory
    levels = dict(memory.levels)
    levels["shared_cores"] = dataclasses.replace(levels["shared_cores"], policy="ratios",
                                                 min_ratio=100, low_ratio=0)
    return dataclasses.replace(Config(), memory=dataclasses.replace(
        memory, levels=frozen_map(levels)))


def kept_after_pressure(node: Node, online: Path, data: Path, name: str) -> int:
    """The online container writes ``CACHE_MIB`` of page cache, the offline pod streams
    ``PRESSURE_MIB`` through ``kubepods``, past its limit; the online container's file bytes
    after."""
    writer = node.worker(online, online)
    assert writer.ask(f"write {data.parent / name} {CACHE_MIB}") == {"written_mib": CACHE_MIB}
    before = memory_stat(online)["file"]
    assert before >= (CACHE_MIB - 8) * MIB, before
    offline, _ = node.container("besteffort", OFFLINE, f"{name}-offline")
    streamer = node.worker(offline, CGROUP / "kubepods")
    streamed = 0
    for _ in range(PRESSURE_ROUNDS):
        answer = streamer.ask(f"read {data} {PRESSURE_S}")
        assert answer["onset"] is not None, answer  # kubepods' limit was reached
        streamed += answer["mib"]
        if streamed >= PRESSURE_MIB:
            return memory_stat(online)["file"]
    raise AssertionError(f"streamed {streamed} MiB in {PRESSURE_ROUNDS} rounds of {PRESSURE_S} s")


# Two phases of at least PRESSURE_MIB each: 100 s in a guest 28 times slower than its host.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", ["memory.min", "memory.low"])
def test_a_containers_protection_holds_only_with_its_ancestors(node: Node, tmp_path: Path,
                                                               key: str) -> None:
    (CGROUP / "kubepods/memory.max").write_text(str(KUBEPODS_MIB * MIB))
    data = data_file(tmp_path / "stream.bin", STREAM_MIB)
    online, cgroups_path = node.container("burstable", ONLINE, ONLINE_CID)
    # what the CreateContainer answer gives the container (100 % of its request)
    (online / key).write_text(str(REQUEST_MIB * MIB))

    # The container's own protection alone: its pod, tier and kubepods at 0, as kubelet leaves
    # them without MemoryQoS. The kernel takes its page cache like anyone's.
    unprotected = kept_after_pressure(node, online, data, "first")
    assert unprotected < CACHE_MIB * MIB // 2, unprotected
    node.kill_processes()
    data_file(tmp_path / "first", CACHE_MIB)  # what is left of it leaves the page cache

    # drift gives the ancestors the sum below them
    state = NodeState()
    state.replace_all(
        [PodInfo(id="sandbox", uid=ONLINE, name="web", namespace="test",
                 cgroup_parent=f"/kubepods/burstable/pod{ONLINE}")],
        [ContainerInfo(id=ONLINE_CID, pod_sandbox_id="sandbox", name="c",
                       cgroups_path=cgroups_path, memory_request=REQUEST_MIB * MIB,
                       memory_limit=4 * REQUEST_MIB * MIB)])
    sysfs = SysFs("/", AuditLog(MemoryAuditSink()))
    notes = StateFile(str(tmp_path / "state.json"))
    cfg = [protecting(key)]
    loop = DriftLoop(lambda: cfg[0], state, sysfs, layout_for(sysfs), 2048 * MIB, notes=notes)
    loop.cycle(0.0)
    for rel in (f"kubepods/burstable/pod{ONLINE}", "kubepods/burstable", "kubepods"):
        assert read_int(CGROUP / rel / key) == REQUEST_MIB * MIB, rel
    assert read_int(online / key) == REQUEST_MIB * MIB
    other = "memory.low" if key == "memory.min" else "memory.min"
    assert read_int(CGROUP / "kubepods" / other) == 0

    protected = kept_after_pressure(node, online, data, "second")
    assert protected >= (CACHE_MIB - 8) * MIB, (protected, unprotected)

    # memory QoS switched off: the ancestors are back at 0
    cfg[0] = dataclasses.replace(cfg[0], memory=dataclasses.replace(cfg[0].memory,
                                                                     enabled=False))
    loop.cycle(10.0)
    for rel in (f"kubepods/burstable/pod{ONLINE}", "kubepods/burstable", "kubepods"):
        assert read_int(CGROUP / rel / key) == 0, rel
    assert notes.entries(PROTECTION_NOTES) == {}


@pytest.mark.timeout(120)
def test_a_restarted_agent_writes_back_only_what_still_holds_its_last_write(
        node: Node, tmp_path: Path) -> None:
    node.container("burstable", ONLINE, ONLINE_CID)
    pod, tier = f"kubepods/burstable/pod{ONLINE}", "kubepods/burstable"
    (CGROUP / tier / "memory.low").write_text(str(8 * MIB))  # someone's value before
    sysfs = SysFs("/", AuditLog(MemoryAuditSink()))
    state = str(tmp_path / "state.json")
    sums = {rel: {"memory.low": REQUEST_MIB * MIB} for rel in (pod, tier, "kubepods")}
    AncestorProtection(sysfs, layout_for(sysfs), StateFile(state)).apply(sums, "drift")
    for rel in sums:
        assert read_int(CGROUP / rel / "memory.low") == REQUEST_MIB * MIB, rel
    # kubelet's MemoryQoS takes the pod's over while the agent is down; the kernel keeps whole
    # pages of what it is given
    (CGROUP / pod / "memory.low").write_text(str(200 * MIB + 100))
    restarted = AncestorProtection(sysfs, layout_for(sysfs), StateFile(state))
    assert restarted.restore("memory QoS switched off") == 2
    assert read_int(CGROUP / pod / "memory.low") == 200 * MIB
    assert read_int(CGROUP / tier / "memory.low") == 8 * MIB
    assert read_int(CGROUP / "kubepods" / "memory.low") == 0
    notes = StateFile(state)
    assert (notes.entries(PROTECTION_NOTES), notes.entries(WRITTEN_NOTES)) == ({}, {})
