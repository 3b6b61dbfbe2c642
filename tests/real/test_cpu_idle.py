"""Idle CPU priority on a real cgroup v2 kernel: the agent's loop sets ``cpu.idle`` on the
BestEffort tier, a busy offline task then gets next to none of a CPU an online one wants (half
of it before), and the tier has its value back when the agent stops."""

from __future__ import annotations

import pytest

from tests.support.guest_node import CGROUP, Node
from tests.support.spinners import idle_tier_yields

pytestmark = pytest.mark.vm(numa=2, mem_mib=1024)

SPIN_S = 3.0


@pytest.mark.timeout(120)
def test_the_idle_tier_yields_the_cpu_and_gets_its_priority_back(node: Node) -> None:
    online, _ = node.container("burstable", "c1d1e000-0000-4000-8000-000000000001", "a" * 64)
    offline, _ = node.container("besteffort", "c1d1e000-0000-4000-8000-000000000002", "b" * 64)
    idle_tier_yields(node.spawn, online, offline, CGROUP / "kubepods/besteffort/cpu.idle", "/",
                     SPIN_S)
