"""Drift gives a container's cgroup v1 soft limit back when its level stops asking for one, on
this machine's kernel (cgroup v1 memory controller).

The container is a besteffort pod's memcg with one ``sleep`` in it, made by
:func:`tests.support.v1_memcg.container_memcg`; skipped unless running as root on a host with the
v1 memory controller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import MappingProxyType

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import PodMeta
from hooks.config_fields import frozen_map
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.sysfs import SysFs
from reconciler.loops.drift import DriftLoop
from tests.support.v1_memcg import NEEDS_V1_MEMORY, Subtree, container_memcg, one_container

UID = "66666666-0000-4000-8000-000000000006"
CID = "e" * 64
MIB = 1 << 20

pytestmark = NEEDS_V1_MEMORY


@pytest.fixture
def subtree() -> Iterator[Subtree]:
    with container_memcg("nriqos-release", "besteffort", UID, CID) as made:
        yield made


def reserving(reservation: bool) -> Config:
    """The defaults, with reclaimed_cores protecting half its request as the v1 soft limit."""
    base = Config()
    levels = dict(base.memory.levels)
    levels["reclaimed_cores"] = dataclasses.replace(
        levels["reclaimed_cores"], low_ratio=50, annotation_max_low_ratio=50,
        v1_reservation=reservation)
    return dataclasses.replace(base, memory=dataclasses.replace(
        base.memory, levels=frozen_map(levels)))


def drift(subtree: Subtree, runtimes: int | None) -> tuple[DriftLoop, list[Config]]:
    """A drift loop over the container, whose request of 64 MiB the API gives and the runtime
    gives as ``runtimes``, and its configuration, which the test swaps."""
    state = one_container("besteffort", UID, CID, memory_request=runtimes)
    state.apply_meta(PodMeta(uid=UID, namespace="test", name="real",
                             annotations=MappingProxyType({}), labels=MappingProxyType({}),
                             priority=0, memory_requests=MappingProxyType({"sleeper": 64 * MIB}),
                             memory_limits=MappingProxyType({})))
    sysfs = SysFs("/", AuditLog(MemoryAuditSink()))
    layout = CgroupLayout(1, "cgroupfs", mount=str(subtree.parent))
    config = [reserving(True)]
    return DriftLoop(lambda: config[0], state, sysfs, layout, 1 << 30), config


def test_the_soft_limit_drift_wrote_goes_back_to_the_kernels_value(subtree: Subtree) -> None:
    soft = subtree.container / "memory.soft_limit_in_bytes"
    before = soft.read_text()
    loop, config = drift(subtree, 64 * MIB)
    loop.cycle(0.0)
    assert int(soft.read_text()) == 32 * MIB
    config[0] = reserving(False)
    loop.cycle(10.0)
    assert soft.read_text() == before


def test_a_soft_limit_applied_at_creation_goes_back_to_unlimited(subtree: Subtree) -> None:
    soft = subtree.container / "memory.soft_limit_in_bytes"
    unlimited = soft.read_text()
    soft.write_text(str(32 * MIB))  # the runtime, from the agent's CreateContainer answer
    loop, config = drift(subtree, None)
    loop.cycle(0.0)
    loop.cycle(10.0)
    config[0] = dataclasses.replace(reserving(True), memory=dataclasses.replace(
        reserving(True).memory, enabled=False))
    loop.cycle(20.0)
    assert soft.read_text() == unlimited
