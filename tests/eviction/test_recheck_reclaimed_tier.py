"""The reclaimed tier's shortage (the memory guard's cap below its pods' requests) is relieved
only by evicting the tier's own pods: a pod of another Kubernetes QoS class that claims
``reclaimed_cores`` (any pod may claim a lower level) lives outside the tier's cgroup, so the
cap never held it and its eviction gives the tier nothing. Node-wide pressure is another matter:
any reclaimed pod's memory counts there."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from reconciler.detection.counting import Counting
from reconciler.detection.detectors import RECLAIMED_TIER
from reconciler.detection.signals import NODE, Board
from reconciler.eviction.api import ActivePod
from reconciler.eviction.builtin import in_tree_plugins
from reconciler.eviction.config import EvictionConfig
from reconciler.eviction.facts import pod_facts
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from tests.support.fakesys import GIB, FakeHost

LEVEL = {"qos.nri-qos.io/level": "reclaimed_cores"}
IN_TIER = "71e70000-0000-4000-8000-000000000001"
CLAIMER = "c1a10000-0000-4000-8000-000000000002"


def offered(tmp_path: Path, version: int, driver: str = "cgroupfs") -> list[ActivePod]:
    """The pods as the eviction manager offers them: one in the BestEffort tier and a larger
    burstable one claiming the same level."""
    host = FakeHost(tmp_path, version=version, driver=driver)
    host.set_pod_anon(host.add_pod(IN_TIER, tier="besteffort", annotations=LEVEL), GIB)
    host.set_pod_anon(host.add_pod(CLAIMER, tier="burstable", annotations=LEVEL), 8 * GIB)
    state = NodeState()
    state.replace_all(*host.nri())
    sysfs = SysFs(tmp_path, AuditLog(MemoryAuditSink()))
    facts = pod_facts(state.snapshot(), sysfs, probe_host(sysfs).cgroup)
    assert {f.pod.uid: f.pod.qos_level for f in facts.values()} == {
        IN_TIER: "reclaimed_cores", CLAIMER: "reclaimed_cores"}  # the claim itself holds
    return [f.pod for f in facts.values()]


@pytest.mark.parametrize(("version", "driver"), [(1, "cgroupfs"), (2, "systemd")])
async def test_the_tiers_shortage_evicts_the_tiers_own_pods(tmp_path: Path, version: int,
                                                             driver: str) -> None:
    plugins = in_tree_plugins(Board(), EvictionConfig, lambda: Counting(memcg=True, node=True))
    top = await plugins["reclaimed_pressure"].get_top_eviction_pods(
        offered(tmp_path, version, driver), 2, RECLAIMED_TIER)
    assert top.uids == (IN_TIER,)


async def test_node_pressure_still_takes_the_largest_reclaimed_pod(tmp_path: Path) -> None:
    plugins = in_tree_plugins(Board(), EvictionConfig, lambda: Counting(memcg=True, node=True))
    top = await plugins["system_pressure"].get_top_eviction_pods(offered(tmp_path, 2), 2, NODE)
    assert top.uids == (CLAIMER, IN_TIER)
