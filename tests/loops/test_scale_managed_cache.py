"""The running containers' cache the loops share, on a node of a thousand containers whose pods
come and go every few seconds: a change of the node state costs the containers it changed, not
every container's cgroups path parsed again (each such change is a rebuild, and on a node with
CronJobs or CI runners the state changes every second)."""

from __future__ import annotations

import pytest

import reconciler.loops.common as loops_common
from common.state import NodeState
from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo
from reconciler.host.cgroups import CgroupRef, parse_cgroups_path
from reconciler.loops.common import ManagedCache

PODS = 250
PER_POD = 4


def pod(n: int) -> tuple[PodInfo, list[ContainerInfo]]:
    uid = f"{n:08x}-0000-4000-8000-000000000000"
    parent = f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    info = PodInfo(id=f"sandbox-{n}", uid=uid, name=f"p{n}", namespace="load",
                   cgroup_parent=parent)
    return info, [ContainerInfo(id=f"{n:08x}{c:056x}", pod_sandbox_id=info.id, name=f"c{c}",
                                cgroups_path=f"{parent}:cri-containerd:{n:08x}{c:056x}")
                  for c in range(PER_POD)]


def test_a_pod_started_on_a_full_node_parses_only_its_own_containers_paths(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    def counting(path: str) -> CgroupRef:
        parsed.append(path)
        return parse_cgroups_path(path)

    monkeypatch.setattr(loops_common, "parse_cgroups_path", counting)
    state = NodeState()
    listed = [pod(n) for n in range(PODS)]
    state.replace_all([p for p, _ in listed], [c for _, cs in listed for c in cs])
    cache = ManagedCache()
    assert len(cache.get(state.snapshot())) == PODS * PER_POD
    parsed.clear()

    new, containers = pod(PODS)
    state.pod_view(new.id, lambda: new)
    for container in containers:
        state.put_container(new.id, container, Event.START_CONTAINER)
        cache.get(state.snapshot())
    assert len(cache.get(state.snapshot())) == (PODS + 1) * PER_POD
    assert sorted(parsed) == sorted(c.cgroups_path for c in containers)

    parsed.clear()
    state.remove_pod(listed[0][0].id, Event.REMOVE_POD_SANDBOX)
    assert len(cache.get(state.snapshot())) == PODS * PER_POD
    assert parsed == []
