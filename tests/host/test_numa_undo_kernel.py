"""The NUMA binding undone on this machine's cgroup v1 cpuset controller, read from its files.

A pod the binding loop binds gets ``cpuset.memory_migrate`` set to 1 and ``cpuset.mems`` written;
once the pod is no longer ``reclaimed_cores``, or the binding is switched off by a reload, both
files hold what they held before. The cpuset cgroups are real (a child of the machine's cpuset
hierarchy, kubelet's layout below it, seen by the agent at ``/sys/fs/cgroup/cpuset`` of its
root); the NUMA nodes are a fake tree of two, since the binding does nothing on a host of one.

What one node cannot show: the kernel takes no node but 0, so the container starts with the empty
``cpuset.mems`` a v1 cpuset is made with (no task may join it then) and is bound to node 0;
pages moving to the bound node and back (what ``memory_migrate`` is for) and a restore to other
nodes with tasks in the cgroup need two nodes (``tests/real/test_numa_balance.py``, cgroup v2).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.kubelet_node import remove_cgroup
from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.loops.numa_binding import NUMA_NOTES, NumaBindingLoop
from tests.support.builders import LEVEL, api_pod
from tests.support.fakesys import GIB, FakeHost

CPUSET = Path("/sys/fs/cgroup/cpuset")
UID = "4e4e4e4e-0000-4000-8000-0000000000c1"
CID = "d" * 64
LOW = 1000  # pages: the memory guard's 4 GiB floor decides the watermark

pytestmark = [pytest.mark.real_kernel, pytest.mark.skipif(
    os.geteuid() != 0 or not (CPUSET / "cpuset.memory_migrate").is_file(),
    reason="needs root and the cgroup v1 cpuset controller at /sys/fs/cgroup/cpuset")]


@pytest.fixture
def cpuset() -> Iterator[Path]:
    """A child of the machine's cpuset hierarchy holding kubelet's layout, with the machine's
    CPUs and nodes down to the pod (as kubelet and runc copy them): the container below is made
    by the test."""
    top = CPUSET / f"nriqos-numa-undo-{os.getpid()}"
    made = [top]
    top.mkdir()
    try:
        for path in (top, top / "kubepods", top / "kubepods/burstable",
                     top / f"kubepods/burstable/pod{UID}"):
            if path != top:
                path.mkdir()
                made.append(path)
            for name in ("cpuset.cpus", "cpuset.mems"):
                (path / name).write_text((CPUSET / name).read_text())
        yield top
    finally:
        container = top / f"kubepods/burstable/pod{UID}/{CID}"
        for path in [container, *reversed(made)]:
            remove_cgroup(path, within_s=2.0)


def root_of(tmp_path: Path, cpuset: Path) -> Path:
    """The agent's root: two NUMA nodes, node 1 under its watermark (the binding chooses node
    0), and its cpuset hierarchy the real one of :func:`cpuset`."""
    host = FakeHost(tmp_path / "root")
    host.set_numa([(20 * GIB, 64 * GIB, LOW), (2 * GIB, 64 * GIB, LOW)])
    shutil.rmtree(host.cg("cpuset", ""))
    host.cg("cpuset", "").symlink_to(cpuset)
    return host.root


def node_state() -> NodeState:
    """A Burstable pod (``shared_cores`` by the runtime's view) whose container runs."""
    state = NodeState()
    state.replace_all(
        [PodInfo(id="sb", uid=UID, name="batch", namespace="default",
                 cgroup_parent=f"/kubepods/burstable/pod{UID}")],
        [ContainerInfo(id=CID, pod_sandbox_id="sb", name="c",
                       cgroups_path=f"/kubepods/burstable/pod{UID}/{CID}")])
    return state


@pytest.mark.parametrize("undo", ["no longer reclaimed", "switched off"])
def test_a_binding_undone_gives_back_mems_and_memory_migrate(tmp_path: Path, cpuset: Path,
                                                               undo: str) -> None:
    container = cpuset / f"kubepods/burstable/pod{UID}/{CID}"
    container.mkdir()
    mems, migrate = container / "cpuset.mems", container / "cpuset.memory_migrate"
    before = (mems.read_text(), migrate.read_text())
    assert before == ("\n", "0\n")
    state = node_state()
    state.apply_meta(api_pod(UID, "batch", {LEVEL: "reclaimed_cores"}))
    cfg = [Config()]
    sink = MemoryAuditSink()
    sysfs = SysFs(root_of(tmp_path, cpuset), AuditLog(sink))
    notes = StateFile(str(tmp_path / "state.json"))
    loop = NumaBindingLoop(lambda: cfg[0], state, sysfs, layout_for(sysfs), AuditLog(sink),
                           notes=notes)
    loop.cycle(0.0)
    assert (mems.read_text(), migrate.read_text()) == ("0\n", "1\n")
    [bound] = sink.named("numa_binding")
    assert (bound["pod_uid"], bound["mems"]) == (UID, "0")
    assert len(notes.entries(NUMA_NOTES)) == 2  # both files, before either was written
    if undo == "no longer reclaimed":
        state.apply_meta(api_pod(UID, "batch", {}))  # shared_cores again
    else:
        cfg[0] = dataclasses.replace(cfg[0], numa=dataclasses.replace(cfg[0].numa,
                                                                      enabled=False))
    loop.cycle(10.0)
    assert (mems.read_text(), migrate.read_text()) == before
    assert notes.entries(NUMA_NOTES) == {}
    assert sink.named("cgroup_write_failed") == []
    # Undone for good: the next cycle binds nothing again and writes nothing.
    written = len(sink.named("cgroup_write"))
    loop.cycle(20.0)
    assert (mems.read_text(), migrate.read_text()) == before
    assert len(sink.named("cgroup_write")) == written
