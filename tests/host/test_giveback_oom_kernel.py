"""Drift gives a container's processes kubelet's oom_score_adj back when no policy asks for a score
any more, on this machine's kernel: real processes in a cgroup v1 memory cgroup, their real
``/proc/<pid>/oom_score_adj``.

Builds ``<test parent>/memory/kubepods/burstable/pod<uid>/<id>`` under ``/sys/fs/cgroup/memory``
with two ``sleep`` processes in the container memcg, given kubelet's score as the runtime gives
it, and points the reconciler's cgroup layout at the test parent, so the processes drift
writes to are these two and no other. Skipped unless running as root on a host with the v1 memory
controller.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import PodMeta
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.sysfs import SysFs
from reconciler.loops.drift import DriftLoop
from tests.support.v1_memcg import NEEDS_V1_MEMORY, container_memcg, one_container

UID = "99999999-0000-4000-8000-000000000009"
CID = "f" * 64
KUBELETS = 300
OOM = "qos.nri-qos.io/oom-score-adj"
LEVEL = "qos.nri-qos.io/level"

pytestmark = NEEDS_V1_MEMORY


class Container:
    """The container's processes and a drift loop over it; ``meta`` gives the pod annotations
    through the API, ``observe`` switches the node to observe mode."""

    def __init__(self, parent: Path, pids: list[int]) -> None:
        self.pids = pids
        self.observe = False
        self.state = one_container("burstable", UID, CID, oom_score_adj=KUBELETS)
        sysfs = SysFs("/", AuditLog(MemoryAuditSink())).observing(lambda: self.observe)
        layout = CgroupLayout(1, "cgroupfs", mount=str(parent))
        config = Config()
        self.loop = DriftLoop(lambda: config, self.state, sysfs, layout, 1 << 30)
        self.now = 0.0

    def meta(self, annotations: dict[str, str]) -> None:
        self.state.apply_meta(PodMeta(uid=UID, namespace="test", name="real",
                                      annotations=MappingProxyType(annotations),
                                      labels=MappingProxyType({}), priority=0,
                                      memory_requests=MappingProxyType({}),
                                      memory_limits=MappingProxyType({})))

    def cycle(self) -> list[int]:
        """The processes' scores after one cycle."""
        self.now += 10.0
        self.loop.cycle(self.now)
        return [int(Path(f"/proc/{pid}/oom_score_adj").read_text()) for pid in self.pids]


@pytest.fixture
def container() -> Iterator[Container]:
    # The runtime gives the processes kubelet's score.
    with container_memcg("nriqos-giveback-oom", "burstable", UID, CID, processes=2,
                         oom_score_adj=KUBELETS) as made:
        yield Container(made.parent, [proc.pid for proc in made.processes])


def test_an_annotations_score_goes_back_to_kubelets_when_it_is_removed(
        container: Container) -> None:
    container.meta({OOM: "500"})
    assert container.cycle() == [500, 500]
    container.meta({})
    assert container.cycle() == [KUBELETS, KUBELETS]


def test_a_level_moved_and_moved_back_gives_kubelets_score_back(container: Container) -> None:
    container.meta({LEVEL: "reclaimed_cores"})
    assert container.cycle() == [1000, 1000]
    container.meta({})
    assert container.cycle() == [KUBELETS, KUBELETS]


def test_observe_mode_gives_the_score_back_and_enforce_writes_it_again(
        container: Container) -> None:
    container.meta({OOM: "500"})
    assert container.cycle() == [500, 500]
    Path(f"/proc/{container.pids[1]}/oom_score_adj").write_text("700")  # someone else's
    container.observe = True
    assert container.cycle() == [KUBELETS, 700]
    assert container.cycle() == [KUBELETS, 700]
    container.observe = False
    assert container.cycle() == [500, 500]
