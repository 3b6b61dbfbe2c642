"""Faults on the kernel's side, each with the outcome the agent promises.

resctrl out of CLOS ids (``mkdir`` ENOSPC), a group the kernel will not remove (``rmdir`` EBUSY),
writes the kernel refuses (EBUSY, EINVAL), a cgroup that vanishes while a loop is in the middle of
its cycle, and a ``/sys`` (or ``/proc``) mounted read-only. Real file trees throughout: the errors
come from the kernel, not from a mocked ``open``. A tmpfs out of inodes gives ENOSPC, a mount
point gives EBUSY, a read-only remount gives EROFS, a FIFO holds a loop mid-cycle while the test
removes a cgroup, and a real memcg refuses a limit below what it cannot reclaim.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from bench.kubelet_node import remove_cgroup
from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.levels import LEVEL_NAMES
from hooks.model import ContainerInfo, PodInfo, RuntimeInfo
from hooks.resctrl_groups import plan_class_groups
from nri_plugin.capabilities.resctrl import ResctrlCapability
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import ContainerEvent, PodEvent
from reconciler.host.cgroups import layout_for
from reconciler.host.probe import probe_host
from reconciler.host.resctrlfs import ResctrlFs, read_info
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.loops.drift import DriftLoop
from reconciler.loops.resctrl_tasks import ResctrlTasksLoop
from tests.support.fakesys import GIB, FakeHost, read_ids
from tests.support.resctrl_trees import intel_tree

PREFIX = "nriqos-"
POD_GROUP_ANNOTATION = {"node.koordinator.sh/resctrl":
                        '{"LLC":{"schemata":{"range":[20,80]}},"MB":{"schemata":{"percent":20}}}'}
RUNTIME = RuntimeInfo(name="containerd", version="v2.1.0", nri_version=(0, 12, 0))
BOUND_S = 5.0


def uid(n: int) -> str:
    return f"{n:08x}-0000-4000-8000-00000000000f"


class Mounts:
    """tmpfs mounts made by a test, undone (innermost first) at its end."""

    def __init__(self) -> None:
        self.made: list[Path] = []

    def tmpfs(self, where: Path, options: str = "size=8m") -> Path:
        where.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode()}")
        self.made.append(where)
        return where

    def remount(self, where: Path, options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)

    def unmount(self, where: Path) -> None:
        subprocess.run(["umount", str(where)], check=True)
        self.made.remove(where)


@pytest.fixture
def mounts() -> Iterator[Mounts]:
    made = Mounts()
    yield made
    for where in reversed(made.made):
        subprocess.run(["umount", "-l", str(where)], check=False)


def resctrl_fs(root: Path, sink: MemoryAuditSink) -> ResctrlFs:
    audit = AuditLog(sink)
    sysfs = SysFs("/", audit)
    return ResctrlFs(sysfs, str(root), read_info(sysfs, str(root), 2048), prefix=PREFIX,
                     audit=audit)


def capability(cfg: Config, fs: ResctrlFs, sink: MemoryAuditSink) -> ResctrlCapability:
    return ResctrlCapability(cfg.resctrl, fs, AuditLog(sink), state=NodeState(), strict=False)


def resctrl_config(root: Path) -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, resctrl=dataclasses.replace(cfg.resctrl, root=str(root)))


def shared_pod(n: int, annotations: dict[str, str] | None = None) -> PodInfo:
    return PodInfo(id=f"sb-{n}", uid=uid(n), name=f"p{n}", namespace="ns",
                   annotations=annotations or {})


def container_of(pod: PodInfo) -> ContainerInfo:
    return ContainerInfo(id=f"c-{pod.uid}", pod_sandbox_id=pod.id, name="app")


# -- resctrl: mkdir ENOSPC ------------------------------------------------------------------------


def test_resctrl_out_of_clos_ids_puts_the_pod_in_its_class_group(mounts: Mounts,
                                                                  tmp_path: Path) -> None:
    # A tmpfs out of inodes answers mkdir with ENOSPC, as resctrl does when no CLOS id is left
    # (after the agent's own CLOS budget check let the pod through).
    mnt = mounts.tmpfs(tmp_path / "resctrl", "size=1m,nr_inodes=400")
    root = intel_tree(mnt)
    sink = MemoryAuditSink()
    cfg = resctrl_config(root)
    fs = resctrl_fs(root, sink)
    fs.apply_class_groups(plan_class_groups(cfg.resctrl, fs.info, []), reason="config",
                          warn=pytest.fail)
    st = os.statvfs(mnt)
    mounts.remount(mnt, f"nr_inodes={st.f_files - st.f_ffree}")
    resctrl = capability(cfg, fs, sink)
    pod = shared_pod(1, POD_GROUP_ANNOTATION)
    resctrl.run_pod_sandbox(PodEvent(pod, "shared_cores", RUNTIME))
    assert not (root / f"{PREFIX}pod-{pod.uid}").exists()
    (fallback,) = sink.named("resctrl_fallback")
    assert fallback == {"pod_uid": pod.uid, "group": f"{PREFIX}shared_cores",
                        "reason": "no CLOS left (ENOSPC)"}
    # The container's answer names the class group: the pod runs with its level's allocation.
    settings = resctrl.create_container(ContainerEvent(pod, container_of(pod), "shared_cores",
                                                       RUNTIME))
    assert settings.rdt_class == f"{PREFIX}shared_cores"


# -- resctrl: rmdir EBUSY -------------------------------------------------------------------------


@dataclasses.dataclass
class TasksWorld:
    host: FakeHost
    resctrl: Path
    state: NodeState
    loop: ResctrlTasksLoop
    sink: MemoryAuditSink
    fs: ResctrlFs
    sysfs: SysFs

    def tasks(self, group: str) -> set[int]:
        path = self.resctrl / group / "tasks"
        return set(read_ids(path)) if path.exists() else set()


def tasks_world(root: Path, *, version: int = 1) -> TasksWorld:
    host = FakeHost(root, version=version)
    resctrl = host.make_resctrl()
    for level in LEVEL_NAMES:
        host.add_resctrl_group(PREFIX + level)
    cfg = Config()
    cfg = dataclasses.replace(cfg, reconciler=dataclasses.replace(cfg.reconciler, gc_grace_s=0))
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(root, audit)
    mount = "/" + str(resctrl.relative_to(root))
    fs = ResctrlFs(sysfs, mount, read_info(sysfs, mount, 2048), prefix=PREFIX, audit=audit)
    state = NodeState()
    loop = ResctrlTasksLoop(lambda: cfg, state, sysfs, layout_for(sysfs), fs, audit)
    return TasksWorld(host, resctrl, state, loop, sink, fs, sysfs)


def test_a_group_the_kernel_will_not_remove_stays_and_the_cycle_goes_on(
    mounts: Mounts, tmp_path: Path,
) -> None:
    world = tasks_world(tmp_path)
    gone = world.host.add_resctrl_group(f"{PREFIX}pod-{uid(2)}")
    # A mount point cannot be removed: rmdir answers EBUSY.
    mounts.tmpfs(gone)
    live = world.host.add_pod(uid(1), tier="besteffort")
    world.state.replace_all(*world.host.nri())
    with capture_logs() as logs:
        world.loop.cycle(0.0)
        world.loop.cycle(1.0)
    assert gone.is_dir()
    said = [e for e in logs if e["event"] == "resctrl_group_not_removed"]
    assert len(said) == 1
    assert said[0]["group"] == gone.name
    assert "Device or resource busy" in said[0]["error"]
    assert world.sink.named("resctrl_group_removed") == []
    # The same cycles placed the live pod's tasks.
    assert set(live.containers[0].tids) <= world.tasks(f"{PREFIX}reclaimed_cores")
    # Once the kernel lets go, the next cycle removes it, once.
    mounts.unmount(gone)
    world.loop.cycle(2.0)
    assert not gone.exists()
    assert [r["group"] for r in world.sink.named("resctrl_group_removed")] == [gone.name]


def test_a_group_the_kernel_will_not_remove_while_resctrl_is_off_is_tried_again(
    mounts: Mounts, tmp_path: Path,
) -> None:
    world = tasks_world(tmp_path)
    busy = world.host.add_resctrl_group(f"{PREFIX}pod-{uid(2)}")
    mounts.tmpfs(busy)
    base = Config()
    off = dataclasses.replace(base, resctrl=dataclasses.replace(base.resctrl, enabled=False))
    world.loop._config = lambda: off  # the config store's reload, in short
    with capture_logs() as logs:
        world.loop.cycle(0.0)
        world.loop.cycle(1.0)
    assert busy.is_dir()
    said = [e for e in logs if e["event"] == "resctrl_group_not_removed"]
    assert [e["group"] for e in said] == [busy.name]
    assert "Device or resource busy" in said[0]["error"]
    assert sorted(r["group"] for r in world.sink.named("resctrl_group_removed")) == [
        PREFIX + level for level in sorted(LEVEL_NAMES)]
    # Once the kernel lets go, the next cycle removes it.
    mounts.unmount(busy)
    world.loop.cycle(2.0)
    assert not busy.exists()
    assert world.sink.named("resctrl_group_removed")[-1] == {
        "group": busy.name, "reason": "resctrl.enabled is false"}


def test_removing_a_busy_pod_group_at_remove_pod_sandbox_raises_for_the_failure_policy(
    mounts: Mounts, tmp_path: Path,
) -> None:
    # The capability raises; the stub's failure policy answers RemovePodSandbox empty with an
    # audit record (strict: an error status), see
    # test_stub_failures::test_failing_capability_fails_open_or_strict. The orphaned group is the
    # garbage collector's (the test above).
    root = intel_tree(tmp_path / "resctrl")
    sink = MemoryAuditSink()
    cfg = resctrl_config(root)
    fs = resctrl_fs(root, sink)
    resctrl = capability(cfg, fs, sink)
    pod = shared_pod(3, POD_GROUP_ANNOTATION)
    resctrl.run_pod_sandbox(PodEvent(pod, "shared_cores", RUNTIME))
    group = root / f"{PREFIX}pod-{pod.uid}"
    assert group.is_dir()
    mounts.tmpfs(group / "mon_groups")
    with pytest.raises(OSError, match="Device or resource busy") as error:
        resctrl.remove_pod_sandbox(PodEvent(pod, "shared_cores", RUNTIME))
    assert error.value.errno == errno.EBUSY
    assert group.is_dir()
    assert sink.named("resctrl_group_removed") == []


# -- writes the kernel refuses: EBUSY (and EINVAL) on the real kernel -----------------------------

MEMORY_V1 = Path("/sys/fs/cgroup/memory")


def no_swap() -> bool:
    return len(Path("/proc/swaps").read_text().splitlines()) <= 1


@pytest.mark.real_kernel
@pytest.mark.skipif(os.geteuid() != 0 or not (MEMORY_V1 / "memory.limit_in_bytes").is_file()
                    or not no_swap(),
                    reason="needs root, the cgroup v1 memory controller and no swap")
def test_a_limit_the_kernel_cannot_reclaim_to_is_retried_then_audited() -> None:
    # Without swap, anonymous memory cannot be reclaimed: a memcg limit below it is refused
    # with EBUSY (EINVAL: tests/host/test_real_kernel.py::test_kernel_errors_are_classified).
    memcg = MEMORY_V1 / f"nriqos-faults-{os.getpid()}"
    memcg.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-I", "-c",
         "import os, sys\n"
         f"open('{memcg}/cgroup.procs', 'w').write(str(os.getpid()))\n"
         "b = bytearray(16 << 20)\n"
         "for i in range(0, len(b), 4096): b[i] = 1\n"
         "print('ready', flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with holder:
            assert holder.stdout is not None
            assert holder.stdout.readline() == "ready\n"
            sink = MemoryAuditSink()
            sleeps: list[float] = []
            sysfs = SysFs("/", AuditLog(sink), retries=3, backoff_s=0.01, sleep=sleeps.append)
            limit = f"{memcg}/memory.limit_in_bytes"
            before = (memcg / "memory.limit_in_bytes").read_text()
            assert sysfs.write(limit, str(1 << 20), "test") is Outcome.FAILED
            assert sleeps == [0.01, 0.02]  # three attempts
            (failed,) = sink.named("cgroup_write_failed")
            assert failed["error"] == "EBUSY: Device or resource busy (attempt 3)"
            assert (memcg / "memory.limit_in_bytes").read_text() == before
            # A value it can take is written at once.
            assert sysfs.write(limit, str(256 << 20), "test") is Outcome.WRITTEN
            holder.kill()
    finally:
        holder.kill()
        holder.wait()
        remove_cgroup(memcg, within_s=2.0)


# -- a cgroup that vanishes in the middle of a cycle ----------------------------------------------


class Held:
    """A FIFO standing in for one file a loop reads: the loop's read waits there (mid-cycle)
    until :meth:`release`; :meth:`wait_for_reader` returns once the loop is waiting."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.unlink()
        os.mkfifo(path)
        self._fd: int | None = None

    def wait_for_reader(self) -> None:
        deadline = threading.Event()
        for _ in range(int(BOUND_S / 0.005)):
            try:
                # Opening the write end without blocking works only while a reader has it open.
                self._fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
                return
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
            deadline.wait(0.005)
        raise TimeoutError(f"nothing opened {self.path}")

    def release(self, content: str) -> None:
        assert self._fd is not None
        os.write(self._fd, content.encode())
        os.close(self._fd)


def in_thread(target: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def test_a_cgroup_removed_while_drift_is_mid_cycle_is_skipped_quietly(tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    host.set_numa([(8 * GIB, 16 * GIB, 100)])
    first = host.add_pod(uid(1), tier="besteffort")
    second = host.add_pod(uid(2), tier="besteffort")
    third = host.add_pod(uid(3), tier="besteffort")
    state = NodeState()
    state.replace_all(*host.nri())
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    cfg = Config()
    drift = DriftLoop(lambda: cfg, state, sysfs, layout_for(sysfs), 16 * GIB)
    # Drift reads the first container's processes; there the cycle waits while the second
    # pod's cgroups (and processes) go, as when the runtime removes a pod meanwhile.
    held = Held(host.cg("memory", first.containers[0].rel) / "cgroup.procs")
    thread, errors = in_thread(lambda: drift.cycle(0.0))
    held.wait_for_reader()
    host.remove_pod(second)
    held.release(f"{first.containers[0].pids[0]}\n")
    thread.join(BOUND_S)
    assert not thread.is_alive()
    assert errors == []
    # Nothing failed, nothing was written for the vanished pod; the others were repaired.
    assert sink.named("cgroup_write_failed") == []
    written = {r["path"] for r in sink.named("cgroup_write")}
    assert written == {f"/proc/{p.containers[0].pids[0]}/oom_score_adj" for p in (first, third)}


def test_a_cgroup_removed_while_the_task_loop_is_mid_cycle_is_skipped_quietly(
    tmp_path: Path,
) -> None:
    world = tasks_world(tmp_path)
    first = world.host.add_pod(uid(1), tier="besteffort")
    second = world.host.add_pod(uid(2), tier="besteffort")
    third = world.host.add_pod(uid(3), tier="besteffort")
    world.state.replace_all(*world.host.nri())
    # The first full scan reads each container's thread list: it waits at the first one.
    held = Held(world.host.cg("cpu", first.containers[0].rel) / "tasks")
    with capture_logs() as logs:
        thread, errors = in_thread(lambda: world.loop.cycle(0.0))
        held.wait_for_reader()
        world.host.remove_pod(second)
        held.release("".join(f"{t}\n" for t in first.containers[0].tids))
        thread.join(BOUND_S)
    assert not thread.is_alive()
    assert errors == []
    assert [e for e in logs if e["log_level"] in ("warning", "error")] == []
    group = world.tasks(f"{PREFIX}reclaimed_cores")
    assert set(first.containers[0].tids) | set(third.containers[0].tids) == group


# -- a read-only /sys and /proc -------------------------------------------------------------------


def test_a_read_only_tree_is_said_once_and_nothing_else_breaks(mounts: Mounts,
                                                               tmp_path: Path) -> None:
    root = mounts.tmpfs(tmp_path / "host", "size=16m")
    world = tasks_world(root)
    world.host.set_numa([(8 * GIB, 16 * GIB, 100)])
    pod = world.host.add_pod(uid(1), tier="besteffort")
    world.state.replace_all(*world.host.nri())
    sink = world.sink
    cfg = Config()
    drift = DriftLoop(lambda: cfg, world.state, world.sysfs, layout_for(world.sysfs), 16 * GIB)
    mounts.remount(root, "ro")

    # Reading works: the host is probed as before.
    host = probe_host(SysFs(root), resctrl_mount="/sys/fs/resctrl")
    assert (host.cgroup.version, host.resctrl is not None) == (1, True)
    with capture_logs() as logs:
        drift.cycle(0.0)
        world.loop.cycle(0.0)
        said_first = list(logs)
        for second in range(1, 4):
            drift.cycle(float(second))
            world.loop.cycle(float(second))
    # One error line naming the fix, one audit record: not one per write and cycle.
    (said,) = [e for e in logs if e["event"] == "sysfs_read_only"]
    assert said["log_level"] == "error"
    assert "read-write" in said["hint"]
    (failed,) = sink.named("cgroup_write_failed")
    assert failed["error"].startswith("EROFS")
    assert sink.named("cgroup_write") == []
    assert sink.named("tasks_moved") == []
    # What the first cycles said (the failed write; class groups whose configured schemata
    # cannot be written, once each) is not said again by the cycles after them.
    assert {e["event"] for e in said_first if e["log_level"] == "warning"} == {
        "write_failed", "resctrl_class_group_failed"}
    assert logs[len(said_first):] == []

    # A pod group cannot be made: the pod gets its class group, with the reason.
    resctrl = capability(resctrl_config(world.resctrl), resctrl_fs(world.resctrl, sink), sink)
    annotated = shared_pod(7, POD_GROUP_ANNOTATION)
    resctrl.run_pod_sandbox(PodEvent(annotated, "shared_cores", RUNTIME))
    (fallback,) = sink.named("resctrl_fallback")
    assert fallback["group"] == f"{PREFIX}shared_cores"
    assert "Read-only file system" in fallback["reason"]

    # Writable again: the writes are made, and a later refusal would be said again.
    mounts.remount(root, "rw")
    drift.cycle(10.0)
    # Moves that failed are made again at the task loop's next full scan at the latest.
    for second in range(10, 10 + Config().reconciler.full_scan_every):
        world.loop.cycle(float(second))
    assert f"/proc/{pod.containers[0].pids[0]}/oom_score_adj" in {
        r["path"] for r in sink.named("cgroup_write")}
    assert set(pod.containers[0].tids) <= world.tasks(f"{PREFIX}reclaimed_cores")
