"""NUMA on a real two-node kernel: what the agent reads of each node, the NUMA free detector
(and the eviction manager's NUMA plugin over it), and an offline pod bound to the node with
room, its pages moving there.

The guest has two nodes of 2 GiB, each with its own zones and watermarks in ``/proc/zoneinfo``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.config.schema import Config
from reconciler.detection.publisher import Publisher
from reconciler.detection.service import DetectorsLoop
from reconciler.detection.signals import Board, Level
from reconciler.eviction.api import MetType
from reconciler.eviction.builtin import in_tree_plugins
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import read_nodes
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.host.values import PAGE_SIZE
from reconciler.loops.numa_binding import NumaBindingLoop
from reconciler.mitigation.service import counting_on
from tests.support.guest_node import MIB, Node, numa_stat, one_pod

pytestmark = pytest.mark.vm(numa=2, mem_mib=2048)

UID = "4e4e4e4e-0000-4000-8000-000000000001"
CID = "a" * 64
OTHER = "4e4e4e4e-0000-4000-8000-000000000002"
REPO = Path(__file__).resolve().parents[2]


def zone_lows() -> dict[int, list[int]]:
    """Each node's zones' ``low`` pages, from a whole read of /proc/zoneinfo."""
    lows: dict[int, list[int]] = {}
    node = None
    with open("/proc/zoneinfo") as f:  # a text file object reads to the end
        for line in f:
            words = line.split()
            if line.startswith("Node "):
                node = int(words[1].rstrip(","))
                lows.setdefault(node, [])
            elif len(words) == 2 and words[0] == "low" and node is not None:
                lows[node].append(int(words[1]))
    return lows


def node_meminfo(node: int) -> dict[str, int]:
    found = {}
    for line in Path(f"/sys/devices/system/node/node{node}/meminfo").read_text().splitlines():
        words = line.split()
        found[words[2].rstrip(":")] = int(words[3]) * 1024
    return found


def test_every_node_has_its_own_free_memory_and_low_watermark() -> None:
    lows = zone_lows()
    assert sorted(lows) == [0, 1]
    nodes = read_nodes(SysFs("/"), PAGE_SIZE)
    assert [n.id for n in nodes] == [0, 1]
    for n in nodes:
        expected = sum(lows[n.id])
        # ±1 page per zone: the watermarks move while the kernel runs
        assert abs(n.low_watermark_bytes // PAGE_SIZE - expected) <= len(lows[n.id])
        assert n.low_watermark_bytes > 0
        info = node_meminfo(n.id)
        assert n.total_bytes == info["MemTotal"]
        assert abs(n.free_bytes - info["MemFree"]) < 64 * MIB
    assert nodes[0].free_bytes != nodes[1].free_bytes or nodes[0].total_bytes > 0


def test_probe_reports_both_nodes_and_psi_triggers() -> None:
    """The acceptance check of the harness: ``nri-qos probe --json`` in a v2 guest of two nodes."""
    done = subprocess.run([sys.executable, "-m", "nri_plugin", "probe", "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=300, check=True)
    found = json.loads(done.stdout)
    assert found["cgroup"]["version"] == 2
    lows = zone_lows()
    nodes = found["numa_nodes"]
    assert [n["id"] for n in nodes] == [0, 1]
    for n in nodes:
        assert n["free_bytes"] > 0
        assert abs(n["low_watermark_bytes"] // PAGE_SIZE - sum(lows[n["id"]])) <= len(
            lows[n["id"]])
    trigger = found["psi"]["system_trigger"]
    assert trigger["accepted"], trigger
    assert trigger["window_us"] <= 500_000, trigger


def small_floor() -> Config:
    """The defaults with a floor small enough that an idle 2 GiB node is well above it."""
    base = Config()
    return dataclasses.replace(base, detection=dataclasses.replace(
        base.detection, free_floor_bytes=192 * MIB))


def press_node_1(node: Node) -> subprocess.Popen[str]:
    """An offline pod bound to node 1 takes it down to about 100 MiB free: under the small
    floor, not under half of it."""
    pod, _ = node.container("besteffort", UID, CID)
    (pod / "cpuset.mems").write_text("1")
    return node.holder(pod, (node_meminfo(1)["MemFree"] - 100 * MIB) // MIB)


def detected(cfg: Config, state: NodeState | None = None) -> Board:
    """The board after the real detectors' first cycles (a pod's PSI needs two samples)."""
    sysfs = SysFs("/")
    board = Board()
    publisher = Publisher(board, AuditLog(MemoryAuditSink()), lambda: cfg.detection)
    loop = DetectorsLoop(lambda: cfg, publisher, state or NodeState(), sysfs, probe_host(sysfs))
    for at in range(cfg.detection.entry_samples + 1):
        loop.cycle(float(at))
    return board


def detector_levels(cfg: Config) -> dict[str, Level]:
    return {r.scope: r.level for r in detected(cfg).current() if r.detector == "numa_free"}


def test_numa_free_fires_for_the_pressed_node_only(node: Node) -> None:
    cfg = small_floor()
    assert detector_levels(cfg) == {"numa:0": Level.NONE, "numa:1": Level.NONE}
    holder = press_node_1(node)
    levels = detector_levels(cfg)
    assert levels["numa:0"] is Level.NONE, levels
    assert levels["numa:1"] >= Level.MEDIUM, (levels, node_meminfo(1)["MemFree"])
    holder.kill()
    holder.wait()


def test_an_offline_pod_is_bound_to_the_node_with_room_and_its_pages_move(node: Node) -> None:
    cgroup, cgroups_path = node.container("besteffort", UID, CID)
    (cgroup / "cpuset.mems").write_text("0")
    holder = node.holder(cgroup, 256)
    before = numa_stat(cgroup, "anon")
    assert before[0] >= 250 * MIB
    assert before[1] < 8 * MIB
    # Node 0 is pressed (an online pod's memory on it: its free memory 400 MiB under node 1's),
    # and the floor the binding uses lies between the two nodes' free memory.
    ballast, _ = node.container("burstable", OTHER, "f" * 64)
    (ballast / "cpuset.mems").write_text("0")
    extra = node_meminfo(0)["MemFree"] - node_meminfo(1)["MemFree"] + 400 * MIB
    if extra > 0:
        node.holder(ballast, extra // MIB)
    base = Config()
    floor = node_meminfo(0)["MemFree"] + 150 * MIB
    assert node_meminfo(1)["MemFree"] > floor + 150 * MIB, "node 1 must have room"
    # The binding's own move, in one write: with the NUMA balance on, the binding only adds
    # nodes and the balance moves the pages in steps (tests/real/test_numa_balance.py).
    cfg = dataclasses.replace(
        base, memory_guard=dataclasses.replace(base.memory_guard, watermark_floor_bytes=floor,
                                               watermark_floor_percent=100.0),
        numa_balance=dataclasses.replace(base.numa_balance, enabled=False))
    state = one_pod(UID, "reclaimed_cores", CID, cgroups_path)
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs("/", audit)
    NumaBindingLoop(lambda: cfg, state, sysfs, layout_for(sysfs), audit).cycle(0.0)
    assert (cgroup / "cpuset.mems").read_text().strip() == "1"
    [bound] = sink.named("numa_binding")
    assert bound["mems"] == "1"
    # cgroup v2 migrates a cgroup's pages when its cpuset.mems changes.
    deadline = time.monotonic() + 30
    while numa_stat(cgroup, "anon")[1] < 250 * MIB and time.monotonic() < deadline:
        time.sleep(0.2)
    after = numa_stat(cgroup, "anon")
    assert after[1] >= 250 * MIB, after
    assert after[0] < 8 * MIB, after
    holder.kill()
    holder.wait()


async def test_numa_pressure_waits_for_the_online_pods_own_pressure(node: Node) -> None:
    """A pressed NUMA node while the online pod beside it feels nothing: on cgroup v2 with PSI
    (``mitigation.node_signals = auto``) the eviction manager's NUMA plugin is not met; where
    the node-wide readings are switched on to drive, the same board meets it."""
    online, online_path = node.container("burstable", OTHER, "f" * 64)
    holder = press_node_1(node)
    auto = small_floor()
    state = NodeState()
    state.replace_all(
        [PodInfo(id="web", uid=OTHER, name="web", namespace="test",
                 cgroup_parent=f"/kubepods/burstable/pod{OTHER}")],
        [ContainerInfo(id="f" * 64, pod_sandbox_id="web", name="c", cgroups_path=online_path,
                       memory_request=64 * MIB)])
    board = detected(auto, state)
    readings = {(r.detector, r.scope): r.level for r in board.current()}
    assert readings[("numa_free", "numa:1")] >= Level.MEDIUM, readings
    assert readings[("psi", f"pod:{OTHER}")] is Level.NONE, readings
    host = probe_host(SysFs("/"))
    assert host.pod_psi
    plugin = in_tree_plugins(board, lambda: auto.eviction,
                             counting_on(lambda: auto, host))["numa_pressure"]
    assert (await plugin.threshold_met()).met is MetType.NOT_MET
    on = dataclasses.replace(auto, mitigation=dataclasses.replace(
        auto.mitigation, node_signals="on"))
    plugin = in_tree_plugins(board, lambda: on.eviction,
                             counting_on(lambda: on, host))["numa_pressure"]
    assert (await plugin.threshold_met()).met in {MetType.SOFT_MET, MetType.HARD_MET}
    assert online.exists()
    holder.kill()
    holder.wait()
