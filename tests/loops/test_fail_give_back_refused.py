"""Observe mode gives back what drift wrote; a write back the kernel refuses (this machine's
cgroup v1: a limit below memory it cannot reclaim without swap is EBUSY) keeps its note, so the
value goes back once the kernel takes it instead of being left as drift set it for good."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.kubelet_node import remove_cgroup
from common.audit import AuditLog, MemoryAuditSink
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.sysfs import SysFs
from reconciler.loops.container_values import ContainerValues
from tests.support.v1_memcg import MEMORY_V1, NEEDS_V1_MEMORY

pytestmark = NEEDS_V1_MEMORY

MIB = 1 << 20
CID = "d" * 64


@pytest.fixture
def memcg() -> Iterator[Path]:
    made = MEMORY_V1 / f"nriqos-fail-give-back-{os.getpid()}"
    made.mkdir()
    try:
        yield made
    finally:
        remove_cgroup(made, within_s=2.0)


def hold_anonymous(memcg: Path, mib: int) -> subprocess.Popen[str]:
    """A process in ``memcg`` holding ``mib`` MiB of anonymous memory until killed."""
    holder = subprocess.Popen(
        [sys.executable, "-I", "-c",
         "import os, sys\n"
         f"open('{memcg}/cgroup.procs', 'w').write(str(os.getpid()))\n"
         f"b = bytearray({mib} << 20)\n"
         "for i in range(0, len(b), 4096): b[i] = 1\n"
         "print('ready', flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    assert holder.stdout.readline() == "ready\n"
    return holder


def test_a_give_back_the_kernel_refuses_keeps_its_note_and_is_done_once_it_takes_it(
        memcg: Path) -> None:
    limit = memcg / "memory.limit_in_bytes"
    limit.write_text(str(64 * MIB))
    sink = MemoryAuditSink()
    sysfs = SysFs("/", AuditLog(sink), backoff_s=0.0)
    values = ContainerValues(sysfs, CgroupLayout(1, "cgroupfs", mount=str(memcg.parent)))
    # drift raises the container's limit; the container then uses more than the old one
    values.set(CID, str(memcg), "memory.limit_in_bytes", str(256 * MIB), "drift")
    assert int(limit.read_text()) == 256 * MIB
    with hold_anonymous(memcg, 128) as holder:
        try:
            values.give_back()  # observe mode: the old limit, below what the kernel can reclaim
            assert int(limit.read_text()) == 256 * MIB
            assert sink.named("cgroup_write_failed")[0]["error"].startswith("EBUSY")
            assert CID in values.noted()
        finally:
            holder.kill()
    values.give_back()  # the memory is gone: the kernel takes the old limit
    assert int(limit.read_text()) == 64 * MIB
    assert values.noted() == {}
