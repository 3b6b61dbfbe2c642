"""The NUMA binding undone on this machine's cgroup v1 cpuset controller, read from its files.

A pod the binding loop binds gets ``cpuset.memory_migrate`` set to 1 and ``cpuset.mems`` written;
once the pod is no longer ``reclaimed_cores``, or the binding is switched off by a reload, both
files go back: ``memory_migrate`` to what it held, an empty ``cpuset.mems`` to the nodes the pod
has in effect (``cpuset.effective_mems`` on v1), since the kernel refuses an empty one to a cgroup
with processes. The cpuset cgroups are real (a child of the machine's cpuset hierarchy, kubelet's
layout below it, seen by the agent at ``/sys/fs/cgroup/cpuset`` of its root); the NUMA nodes are a
fake tree of two, since the binding does nothing on a host of one.

What one node cannot show: the kernel takes no node but 0, so the container starts with the empty
``cpuset.mems`` a v1 cpuset is made with (no task may join it then), is bound to node 0 and gets
node 0 back, which it holds already; pages moving to the bound node and back (what
``memory_migrate`` is for) and a restore to other nodes with tasks in the cgroup need two nodes
(``tests/real/test_numa_balance.py``, cgroup v2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from bench.kubelet_node import remove_cgroup
from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.statefile import StateFile, restore_noted
from reconciler.host.sysfs import SysFs
from reconciler.loops.numa_binding import NUMA_NOTES, NumaBindingLoop
from tests.support.builders import LEVEL, api_pod
from tests.support.fakesys import GIB, FakeHost
from tests.support.realroot import in_cgroup

CPUSET = Path("/sys/fs/cgroup/cpuset")
UID = "4e4e4e4e-0000-4000-8000-0000000000c1"
CID = "d" * 64
NOTED = f"/sys/fs/cgroup/cpuset/kubepods/burstable/pod{UID}/{CID}"
"""The container's cpuset as the agent names it."""
MEMS = f"{NOTED}/cpuset.mems"
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
    # Both files, before either was written; v1 has no nodes in effect for an empty one.
    assert notes.entries(NUMA_NOTES) == {MEMS: "", f"{NOTED}/cpuset.memory_migrate": "0"}
    if undo == "no longer reclaimed":
        state.apply_meta(api_pod(UID, "batch", {}))  # shared_cores again
    else:
        cfg[0] = dataclasses.replace(cfg[0], numa=dataclasses.replace(cfg[0].numa,
                                                                      enabled=False))
    loop.cycle(10.0)
    back = ((container.parent / "cpuset.effective_mems").read_text(), before[1])
    assert back == ("0\n", "0\n")
    assert (mems.read_text(), migrate.read_text()) == back
    assert notes.entries(NUMA_NOTES) == {}
    assert sink.named("cgroup_write_failed") == []
    # Undone for good: the next cycle binds nothing again and writes nothing.
    written = len(sink.named("cgroup_write"))
    loop.cycle(20.0)
    assert (mems.read_text(), migrate.read_text()) == back
    assert len(sink.named("cgroup_write")) == written


@contextlib.contextmanager
def running(container: Path) -> Iterator[int]:
    """A process in ``container``, its nodes and CPUs the pod's (as runc starts one on v1):
    the pid; killed at the end."""
    for name in ("cpuset.cpus", "cpuset.mems"):
        (container / name).write_text((container.parent / name).read_text())
    process = subprocess.Popen(in_cgroup(container, ["sleep", "600"]))
    try:
        deadline = time.monotonic() + 10.0
        while str(process.pid) not in (container / "tasks").read_text().split():
            assert time.monotonic() < deadline, "the process never joined its cpuset"
            time.sleep(0.01)
        yield process.pid
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("undo", ["no longer reclaimed", "switched off"])
def test_an_empty_note_of_a_cpuset_with_a_process_goes_back_as_the_pods_nodes(
        tmp_path: Path, cpuset: Path, undo: str) -> None:
    """An earlier agent's note of an empty cpuset.mems, its container holding a process by now:
    the kernel refuses that an empty one (ENOSPC), so it gets the nodes the pod has in effect,
    and the note goes."""
    container = cpuset / f"kubepods/burstable/pod{UID}/{CID}"
    container.mkdir()
    with running(container):
        state = node_state()  # Burstable: shared_cores, no longer bound
        cfg = Config()
        if undo == "switched off":
            state.apply_meta(api_pod(UID, "batch", {LEVEL: "reclaimed_cores"}))
            cfg = dataclasses.replace(cfg, numa=dataclasses.replace(cfg.numa, enabled=False))
        sink = MemoryAuditSink()
        sysfs = SysFs(root_of(tmp_path, cpuset), AuditLog(sink))
        notes = StateFile(str(tmp_path / "state.json"))
        notes.put(NUMA_NOTES, MEMS, "")
        loop = NumaBindingLoop(lambda: cfg, state, sysfs, layout_for(sysfs), AuditLog(sink),
                               notes=notes)
        with capture_logs() as logs:
            for now in (0.0, 10.0, 20.0):
                loop.cycle(now)
        assert (container / "cpuset.mems").read_text() == (
            container.parent / "cpuset.effective_mems").read_text() == "0\n"
        assert StateFile(notes.path).entries(NUMA_NOTES) == {}
        assert sink.named("cgroup_write_failed") == []
        assert [e for e in logs if e["event"] == "restore_abandoned"] == []


def test_an_empty_value_the_kernel_refuses_a_cpuset_with_a_process_is_dropped_once(
        tmp_path: Path, cpuset: Path) -> None:
    """Written back as it is (no resolver), an empty note of a cgroup with a process meets the
    kernel's ENOSPC: one warning and one failed write, then the note is gone, not retried."""
    container = cpuset / f"kubepods/burstable/pod{UID}/{CID}"
    container.mkdir()
    with running(container):
        sink = MemoryAuditSink()
        sysfs = SysFs(root_of(tmp_path, cpuset), AuditLog(sink))
        notes = StateFile(str(tmp_path / "state.json"))
        notes.put(NUMA_NOTES, MEMS, "")
        with capture_logs() as logs:
            for _ in range(3):
                assert restore_noted(sysfs, notes, NUMA_NOTES, "test") == 0
        enospc = f"ENOSPC: {os.strerror(errno.ENOSPC)}"
        assert [(e["path"], e["error"]) for e in logs if e["event"] == "restore_abandoned"] == [
            (MEMS, enospc)]
        assert [r["error"] for r in sink.named("cgroup_write_failed")] == [
            f"{enospc} (attempt 1)"]
        assert StateFile(notes.path).entries(NUMA_NOTES) == {}
        assert (container / "cpuset.mems").read_text() == "0\n"
