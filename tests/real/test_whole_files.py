"""Every kernel file the agent reads arrives whole through ``SysFs.read``.

A seq_file hands out whole records one buffer at a time, so its first ``read()`` can stop early
(``/proc/zoneinfo`` of a two-node guest comes in two pieces): the agent's reader must go on to
the end. Each file is compared with a read through a text file object, which always reads to
the end: the same lines, in the same order, with the same keys (counters move between reads).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reconciler.host.numa import node_lows, parse_zoneinfo
from reconciler.host.sysfs import SysFs, read_file_bytes
from reconciler.host.values import PAGE_SIZE
from tests.support.guest_node import CGROUP, Node

pytestmark = pytest.mark.vm(numa=2, mem_mib=2048)

UID = "f1f1f1f1-0000-4000-8000-000000000001"
# Every file of /proc and /sys the agent reads, by kind; cgroup files of a pod below.
NODE_FILES = [
    "/proc/zoneinfo", "/proc/vmstat", "/proc/meminfo", "/proc/pressure/memory",
    "/proc/sys/vm/watermark_scale_factor", "/sys/devices/system/node/node0/meminfo",
    "/sys/devices/system/node/node1/meminfo", "/sys/devices/system/node/online",
    "/proc/self/mounts", "/proc/self/cgroup", "/sys/fs/cgroup/cgroup.controllers",
]
POD_FILES = ["memory.stat", "memory.numa_stat", "memory.pressure", "memory.current",
             "memory.max", "memory.high", "memory.low", "memory.min", "memory.events",
             "cgroup.procs", "cpuset.mems", "cpuset.cpus.effective"]


def keys(text: str) -> list[str]:
    """Each line's first word: what must be there in both reads, whatever the counters say."""
    return [line.split()[0] if line.split() else "" for line in text.splitlines()]


def whole(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def test_zoneinfo_comes_in_pieces_here_and_arrives_whole() -> None:
    fd = os.open("/proc/zoneinfo", os.O_RDONLY)
    try:
        first = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    text = whole("/proc/zoneinfo")
    # The case the reader must handle: one read() is not the whole file.
    assert len(first) < len(text.encode())
    data = read_file_bytes("/proc/zoneinfo")
    assert data is not None
    assert keys(data.decode()) == keys(text)
    lows = node_lows(parse_zoneinfo(data.decode()), PAGE_SIZE)
    assert sorted(lows) == [0, 1]
    assert all(low > 0 for low in lows.values()), lows


@pytest.mark.parametrize("path", NODE_FILES)
def test_node_files_arrive_whole(path: str) -> None:
    assert Path(path).exists(), path
    got = SysFs("/").read(path)
    assert got is not None
    assert keys(got) == keys(whole(path))


def test_pod_cgroup_files_arrive_whole(node: Node) -> None:
    cgroup, _ = node.container("besteffort", UID, "e" * 64)
    holder = node.holder(cgroup, 8)
    sysfs = SysFs("/")
    for name in POD_FILES:
        for directory in (cgroup, cgroup.parent, CGROUP / "kubepods"):
            path = directory / name
            got = sysfs.read(str(path))
            assert got is not None, path
            assert keys(got) == keys(whole(str(path))), path
    holder.kill()
    holder.wait()
