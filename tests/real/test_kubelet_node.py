"""The benchmark's kubelet-shaped node on a real cgroup v2 kernel: a root that enables no
controller for its children (one not set up by systemd) is set up as systemd does, and the node
passes ``kubepods``' protection through, as a machine's root cgroup does, so that the machine's
own reclaim honours what kubelet's MemoryQoS or the agent give the pods."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.colocation import memory_qos
from bench.colocation_indicators import vmstat
from bench.colocation_plan import ONLINE
from bench.kubelet_node import MIB, Container, KubeletNode
from tests.support.guest_node import read_int
from tests.support.realroot import data_file

pytestmark = pytest.mark.vm(numa=1, mem_mib=1024)

ROOT = Path("/sys/fs/cgroup")
CACHE_MIB = 128
"""The online container's page cache."""
LOW_MIB = 160
"""Its ``memory.low``, on it and every cgroup above it up to ``kubepods``: above what it holds."""
STREAM_MIB = 2048
"""What an offline pod reads once: twice the guest's memory, so the machine must reclaim."""


def test_a_root_that_enables_nothing_is_set_up_as_systemd_does() -> None:
    before = (ROOT / "cgroup.subtree_control").read_text().split()
    (ROOT / "cgroup.subtree_control").write_text(" ".join(f"-{c}" for c in before))
    assert (ROOT / "cgroup.subtree_control").read_text().split() == []
    try:
        node = KubeletNode("bare", 256 * MIB, 64 * MIB, 1)
        try:
            assert int((node.memory / "memory.max").read_text()) == 256 * MIB
            assert int((node.memory / "kubepods/memory.max").read_text()) == 192 * MIB
        finally:
            node.close()
        assert {"memory", "cpu"} <= set((ROOT / "cgroup.subtree_control").read_text().split())
    finally:
        (ROOT / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in before))


def test_the_node_carries_what_kubepods_protects_as_it_changes() -> None:
    node = KubeletNode("carry", 256 * MIB, 64 * MIB, 1)
    try:
        online = node.add_pod(ONLINE.tier, ONLINE.uid, ONLINE.container_id,
                              memory_limit=ONLINE.memory_limit, cpu_request_milli=1000)
        assert memory_qos(node, ONLINE, online)[0] == f"memory.min={ONLINE.memory_request}"
        # kubelet's MemoryQoS: the request on every cgroup from the container up to kubepods
        for rel in (online.rel, online.pod_rel, "kubepods/burstable", "kubepods"):
            assert read_int(node.memory / rel / "memory.min") == ONLINE.memory_request, rel
        assert read_int(node.memory / "memory.min") == 0
        node.pass_protection()
        assert read_int(node.memory / "memory.min") == ONLINE.memory_request
        assert read_int(node.memory / "memory.low") == 0
        (node.memory / "kubepods/memory.low").write_text(str(LOW_MIB * MIB))
        (node.memory / "kubepods/memory.min").write_text("0")
        node.pass_protection()
        assert read_int(node.memory / "memory.low") == LOW_MIB * MIB
        assert read_int(node.memory / "memory.min") == 0
    finally:
        node.close()


def run_in(node: KubeletNode, container: Container, path: Path) -> None:
    """Read ``path`` once from inside ``container``: its pages are charged there."""
    process = node.spawn(container.rel, ["cat", str(path)], oom_score_adj=0,
                         stdout=subprocess.DEVNULL)
    assert process.wait(timeout=240) == 0


def kept_after_stream(node: KubeletNode, online: Container, offline: Container, cache: Path,
                      stream: Path) -> int:
    """The online container reads its files (what it held of them before dropped first), an
    offline pod then streams more than the machine has; the online container's file bytes
    after."""
    data_file(cache, CACHE_MIB)
    data_file(stream, STREAM_MIB)
    run_in(node, online, cache)
    assert node.stat(online.rel)["file"] >= (CACHE_MIB - 8) * MIB
    hits, scanned = node.limit_hits("kubepods"), scan()
    run_in(node, offline, stream)
    # the machine reclaimed, not kubepods at its node-allocatable limit
    assert node.limit_hits("kubepods") == hits
    assert scan() > scanned
    return node.stat(online.rel)["file"]


def scan() -> int:
    return sum(vmstat(key) or 0 for key in ("pgscan_kswapd", "pgscan_direct"))


@pytest.mark.timeout(600)  # 2 GiB written, then streamed twice, in a guest under TCG
def test_protection_below_the_node_holds_under_the_machines_reclaim_once_passed(
        tmp_path: Path) -> None:
    # kubepods may take more than the guest has: only the machine's reclaim can press it
    node = KubeletNode("machine", 1024 * MIB, 16 * MIB, 1)
    try:
        online = node.add_pod(ONLINE.tier, ONLINE.uid, ONLINE.container_id,
                              memory_limit=ONLINE.memory_limit, cpu_request_milli=1000)
        offline = node.add_pod("besteffort", "0c010c01-0000-4000-8000-0000000000ff", "f" * 64,
                               memory_limit=None, cpu_request_milli=0)
        for rel in (online.rel, online.pod_rel, "kubepods/burstable", "kubepods"):
            (node.memory / rel / "memory.low").write_text(str(LOW_MIB * MIB))
        # the node at 0, as a child of the root: it bounds kubepods' protection to nothing
        unprotected = kept_after_stream(node, online, offline, tmp_path / "a", tmp_path / "s")
        assert unprotected < CACHE_MIB * MIB // 2, unprotected
        node.pass_protection()
        protected = kept_after_stream(node, online, offline, tmp_path / "a", tmp_path / "s")
        assert protected >= (CACHE_MIB - 8) * MIB, (protected, unprotected)
    finally:
        node.close()


def test_going_over_memory_high_counts_as_throttled_and_not_as_a_limit_hit(
        tmp_path: Path) -> None:
    node = KubeletNode("high", 512 * MIB, 16 * MIB, 1)
    try:
        offline = node.add_pod("besteffort", "0c010c01-0000-4000-8000-0000000000fd", "e" * 64,
                               memory_limit=None, cpu_request_milli=0)
        assert node.throttle_hits(offline.rel) == 0
        (node.memory / offline.rel / "memory.high").write_text(str(32 * MIB))
        data_file(tmp_path / "d", 64)
        run_in(node, offline, tmp_path / "d")
        # twice its memory.high read through it: reclaimed back under it, never at a limit
        throttled = node.throttle_hits(offline.rel)
        assert throttled is not None
        assert throttled > 0
        assert node.limit_hits(offline.rel) == 0
        assert node.stat(offline.rel)["file"] <= 32 * MIB
    finally:
        node.close()
