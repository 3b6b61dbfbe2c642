"""The benchmark's kubelet-shaped node on a cgroup v2 root that enables no controller for its
children (a root not set up by systemd): the node enables them, as systemd does."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.kubelet_node import MIB, KubeletNode

pytestmark = pytest.mark.vm(numa=1, mem_mib=1024)

ROOT = Path("/sys/fs/cgroup")


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
