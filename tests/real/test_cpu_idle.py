"""Idle CPU priority on a real cgroup v2 kernel: the agent's loop sets ``cpu.idle`` on the
BestEffort tier, a busy offline task then gets next to none of a CPU an online one wants (half
of it before), and the tier has its value back when the agent stops."""

from __future__ import annotations

import dataclasses

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.loops.cpu_idle import CpuIdleLoop
from tests.support.guest_node import CGROUP, Node
from tests.support.spinners import shares

pytestmark = pytest.mark.vm(numa=2, mem_mib=1024)

SPIN_S = 3.0


@pytest.mark.timeout(120)
def test_the_idle_tier_yields_the_cpu_and_gets_its_priority_back(node: Node) -> None:
    online, _ = node.container("burstable", "c1d1e000-0000-4000-8000-000000000001", "a" * 64)
    offline, _ = node.container("besteffort", "c1d1e000-0000-4000-8000-000000000002", "b" * 64)
    tier = CGROUP / "kubepods/besteffort/cpu.idle"
    assert tier.read_text().strip() == "0"
    before = shares(node.spawn, [online, offline], SPIN_S)
    assert min(before) > 0.3, before  # equal weights: about half each

    cfg = Config()
    cfg = dataclasses.replace(cfg, cpu_idle=dataclasses.replace(cfg.cpu_idle, enabled=True))
    sysfs = SysFs("/", AuditLog(MemoryAuditSink()))
    loop = CpuIdleLoop(lambda: cfg, sysfs, layout_for(sysfs), StateFile(None))
    loop.cycle(0.0)
    assert tier.read_text().strip() == "1"
    online_share, offline_share = shares(node.spawn, [online, offline], SPIN_S)
    assert online_share > 0.8, (online_share, offline_share)
    assert offline_share < 0.25, (online_share, offline_share)

    loop.close()
    assert tier.read_text().strip() == "0"
