"""Kernel features missing or refused, at the probe and in the loops that read them: each is
said, and the agent degrades as documented instead of failing or acting on figures it lacks."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from reconciler.detection.config import DetectionConfig
from reconciler.detection.notified import psi_path
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import NumaFormatError, read_nodes
from reconciler.host.probe import PSI_MEMORY, probe_host
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_guard import MemoryGuardLoop
from tests.support.fakesys import GIB, PAGE, FakeHost, write
from tests.support.guard_config import standing


class PsiDisabledSysFs(SysFs):
    """A kernel booted with ``psi=0`` whose pressure files are still there: reading one
    fails with EOPNOTSUPP (``psi_show`` on kernels that keep ``/proc/pressure``)."""

    def read(self, path: str) -> str | None:
        if path.startswith("/proc/pressure/") or path.endswith(".pressure"):
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP), path)
        return super().read(path)


def test_pressure_files_that_refuse_reads_leave_psi_off_with_the_reason(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=1)
    host.set_numa([(8 * GIB, 16 * GIB, 1000)])
    write(tmp_path / "proc/pressure/memory", "")
    info = probe_host(PsiDisabledSysFs(tmp_path, AuditLog(MemoryAuditSink())))
    assert not info.psi.readable
    assert info.psi.system.window_us is None
    assert "ENOTSUP" in info.psi.system.problem  # EOPNOTSUPP has the same number
    path, reason = psi_path(DetectionConfig(), info)
    assert path == "off"
    assert PSI_MEMORY in reason
    assert "ENOTSUP" in reason


def node_meminfo(root: Path, node: int, text: str) -> None:
    write(root / f"sys/devices/system/node/node{node}/meminfo", text)


def test_a_node_meminfo_without_memfree_is_an_error_not_zero_free(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=1)
    host.set_numa([(8 * GIB, 16 * GIB, 1000)])
    node_meminfo(tmp_path, 0, "Node 0 MemTotal:       16777216 kB\n")
    with pytest.raises(NumaFormatError, match="node 0 meminfo lacks MemFree"):
        read_nodes(SysFs(tmp_path), PAGE)


def test_a_meminfo_without_memfree_on_a_kernel_without_numa_is_an_error(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=1)
    host.set_numa([(8 * GIB, 16 * GIB, 1000)])
    for name in ("meminfo", "online"):
        (tmp_path / "sys/devices/system/node" / (f"node0/{name}" if name == "meminfo"
                                                  else name)).unlink()
    (tmp_path / "sys/devices/system/node/node0").rmdir()
    write(tmp_path / "proc/meminfo", "MemTotal:       16777216 kB\n")
    with pytest.raises(NumaFormatError, match="/proc/meminfo lacks MemFree"):
        read_nodes(SysFs(tmp_path), PAGE)


def test_the_memory_guard_does_not_cap_from_a_node_meminfo_without_memfree(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path, version=1)
    host.set_numa([(8 * GIB, 16 * GIB, 1000)])
    host.set_tier_usage("besteffort", 2 * GIB, per_node=[2 * GIB])
    node_meminfo(tmp_path, 0, "Node 0 MemTotal:       16777216 kB\nNode 0 MemUsed: 1 kB\n")
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit)
    cfg = standing()
    loop = MemoryGuardLoop(lambda: cfg, sysfs, layout_for(sysfs), audit)
    with pytest.raises(NumaFormatError, match="lacks MemFree"):
        loop.cycle(0.0)
    assert sink.named("memory_guard_cap") == []
    limit = host.tier_dir("besteffort") / "memory.limit_in_bytes"
    assert limit.read_text() == "9223372036854771712\n"
