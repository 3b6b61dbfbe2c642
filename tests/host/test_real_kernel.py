"""The guard and drift writes against this machine's kernel (cgroup v1 memory controller).

The container is a besteffort pod's memcg with one ``sleep`` in it, made by
:func:`tests.support.v1_memcg.container_memcg` so every write lands in that subtree and nowhere
else; skipped unless running as root on a host with the v1 memory controller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from common.audit import AuditLog, MemoryAuditSink
from hooks.memory_qos import MemoryLevel
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.numa import check_view, read_meminfo, read_nodes
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.host.values import parse_bytes
from reconciler.loops.drift import DriftLoop
from reconciler.loops.memory_guard import MemoryGuardLoop
from tests.support.v1_memcg import NEEDS_V1_MEMORY, Subtree, container_memcg, one_container

UID = "55555555-0000-4000-8000-000000000005"
CID = "f" * 64
MIB = 1 << 20

pytestmark = NEEDS_V1_MEMORY


@pytest.fixture
def subtree() -> Iterator[Subtree]:
    with container_memcg("nriqos-test", "besteffort", UID, CID) as made:
        yield made


def config() -> Config:
    base = Config()
    levels = dict(base.memory.levels)
    levels["reclaimed_cores"] = MemoryLevel(policy="ratios", high_ratio=95, low_ratio=50,
                                            v1_reservation=True)
    return dataclasses.replace(
        base,
        memory=dataclasses.replace(base.memory, levels=MappingProxyType(levels)),
        # No floor: on a small test machine the 4 GiB default leaves no headroom at all.
        memory_guard=dataclasses.replace(base.memory_guard, watermark_floor_bytes=0),
    )


def test_guard_and_drift_take_effect(subtree: Subtree) -> None:
    cfg = config()
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs("/", audit)
    layout = CgroupLayout(1, "cgroupfs", mount=str(subtree.parent))

    MemoryGuardLoop(lambda: cfg, sysfs, layout, audit).cycle(0.0)
    [record] = sink.named("memory_guard_cap")
    limit = int((subtree.tier / "memory.limit_in_bytes").read_text())
    assert limit == record["cap_bytes"]
    nodes = read_nodes(sysfs, 4096)
    total = read_meminfo(sysfs)["MemTotal"]
    assert 0 < limit <= total
    if not check_view(nodes, total, 10.0).consistent:
        # Hot-added memory missing from the nodes' meminfo (this kind of VM): the cap comes
        # from the machine's free memory, not from the nodes' much smaller view.
        [seen] = sink.named("numa_view_inconsistent")
        assert seen["system_total_bytes"] == total
        assert limit > sum(n.free_bytes for n in nodes)

    state = one_container("besteffort", UID, CID, memory_request=64 * MIB)
    drift = DriftLoop(lambda: cfg, state, sysfs, layout, total)
    drift.cycle(0.0)
    (process,) = subtree.processes
    pid = process.pid
    assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "1000"
    assert int((subtree.container / "memory.soft_limit_in_bytes").read_text()) == 32 * MIB
    written = len(sink.named("cgroup_write"))
    drift.cycle(10.0)  # the kernel's values read back equal: no second write
    assert len(sink.named("cgroup_write")) == written


def test_kernel_errors_are_classified(subtree: Subtree) -> None:
    sink = MemoryAuditSink()
    sysfs = SysFs("/", AuditLog(sink), backoff_s=0.0)
    procs = f"{subtree.container}/cgroup.procs"
    # a task id that does not exist: ESRCH, tolerated
    assert sysfs.write(procs, str(2**22 + 12345), "test") == Outcome.GONE
    # garbage for a limit: EINVAL, retried then audited
    limit = f"{subtree.container}/memory.limit_in_bytes"
    assert sysfs.write(limit, "lots", "test") == Outcome.FAILED
    assert sink.named("cgroup_write_failed")[0]["error"].startswith("EINVAL")


def test_no_limit_is_written_as_the_v1_file_takes_it(subtree: Subtree) -> None:
    """The guard lifts a tier's limit with the layout's ``unlimited``: v1's file refuses the
    ``max`` of v2 (EINVAL) and takes ``-1``."""
    sysfs = SysFs("/", AuditLog(MemoryAuditSink()), backoff_s=0.0)
    limit = f"{subtree.tier}/memory.limit_in_bytes"
    assert sysfs.write(limit, str(512 * MIB), "test") == Outcome.WRITTEN
    assert sysfs.write(limit, "max", "test") == Outcome.FAILED
    assert int(Path(limit).read_text()) == 512 * MIB
    assert sysfs.write(limit, CgroupLayout(1, "cgroupfs").unlimited, "test") == Outcome.WRITTEN
    assert parse_bytes(Path(limit).read_text()) is None
