"""The ladder's squeeze on this machine's cgroup v1 kernel, against a job that grows its
anonymous memory: at a hard limit the kernel kills it, so the guard turns the tier's OOM killer
off before it writes the squeezed limit; the job then waits at the limit, goes on as the
guard's cycles raise it a step above the tier's anonymous memory, and nothing is killed. When
the squeeze ends the limit goes back up first, then the killer. Builds
``<test parent>/memory/kubepods/besteffort/pod<uid>/<id>`` under ``/sys/fs/cgroup/memory``;
skipped unless root on a host with the v1 memory controller."""

from __future__ import annotations

import dataclasses
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_guard import MemoryGuardLoop
from reconciler.loops.memory_squeeze import OOM_CONTROL, GuardSqueeze, Squeeze

MEMORY_V1 = Path("/sys/fs/cgroup/memory")
UID = "66666666-0000-4000-8000-000000000006"
CID = "e" * 64
MIB = 1 << 20
STEP = 32 * MIB

pytestmark = [pytest.mark.real_kernel, pytest.mark.skipif(
    os.geteuid() != 0 or not (MEMORY_V1 / "memory.limit_in_bytes").is_file(),
    reason="needs root and the cgroup v1 memory controller")]

GROWER = (
    "import sys\n"
    "first = bytearray(64 << 20)\n"
    "for i in range(0, len(first), 4096): first[i] = 1\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "more = bytearray(160 << 20)\n"
    "for i in range(0, len(more), 4096): more[i] = 1\n"
    "print('grown', flush=True)\n"
    "sys.stdin.readline()\n"
)


@dataclasses.dataclass
class Tier:
    parent: Path
    tier: Path
    container: Path

    def oom(self, memcg: Path | None = None) -> dict[str, int]:
        text = ((memcg or self.tier) / OOM_CONTROL).read_text()
        return {k: int(v) for k, v in (line.split() for line in text.splitlines())}

    def limit(self) -> int:
        return int((self.tier / "memory.limit_in_bytes").read_text())

    def spawn(self) -> subprocess.Popen[str]:
        procs = self.container / "cgroup.procs"
        grower = subprocess.Popen(
            ["sh", "-c", f'echo $$ > {procs} && exec "$0" -I -c "$1"', sys.executable, GROWER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert grower.stdout is not None
        assert grower.stdout.readline() == "ready\n"
        return grower


@pytest.fixture
def tier() -> Iterator[Tier]:
    parent = MEMORY_V1 / f"nriqos-squeeze-{os.getpid()}"
    t = parent / "memory/kubepods/besteffort"
    container = t / f"pod{UID}" / CID
    container.mkdir(parents=True)
    try:
        yield Tier(parent, t, container)
    finally:
        for d in (container, container.parent, t, t.parent, t.parent.parent, parent):
            for _ in range(50):  # a killed task leaves its memcg a moment later
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def stop(grower: subprocess.Popen[str]) -> None:
    grower.kill()
    grower.communicate()


def answered(grower: subprocess.Popen[str], seconds: float) -> bool:
    assert grower.stdout is not None
    return bool(select.select([grower.stdout], [], [], seconds)[0])


def test_a_hard_limit_at_a_growing_jobs_memory_kills_it(tier: Tier) -> None:
    """The kernel fact the guard works around: v1's limit is hard."""
    grower = tier.spawn()
    try:
        used = int((tier.tier / "memory.usage_in_bytes").read_text())
        (tier.tier / "memory.limit_in_bytes").write_text(str(used + STEP))
        assert grower.stdin is not None
        grower.stdin.write("grow\n")
        grower.stdin.flush()
        assert grower.wait(timeout=30) == -9
        assert tier.oom(tier.container)["oom_kill"] == 1  # counted where the victim was
    finally:
        stop(grower)


def test_a_squeezed_tier_holds_a_growing_job_without_killing_it(tier: Tier) -> None:
    base = Config()
    cfg = dataclasses.replace(base, memory_guard=dataclasses.replace(
        base.memory_guard, standing_cap="never"))
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs("/", audit)
    squeeze = GuardSqueeze()
    loop = MemoryGuardLoop(lambda: cfg, sysfs, CgroupLayout(1, "cgroupfs", mount=str(tier.parent)),
                           audit, squeeze)
    unlimited = tier.limit()
    grower = tier.spawn()
    try:
        squeeze.set(Squeeze(STEP, 16 * MIB, "test", 1))
        loop.cycle(0.0)
        tight = tier.limit()
        assert tight < unlimited
        assert tier.oom()["oom_kill_disable"] == 1
        assert grower.stdin is not None
        grower.stdin.write("grow\n")
        grower.stdin.flush()
        # 160 MiB more against a step of 32: the job waits at the limit, alive
        assert not answered(grower, 3.0), "the job was not held"
        assert grower.poll() is None
        assert tier.oom()["under_oom"] == 1
        # each cycle raises the limit a step above the tier's anonymous memory: it goes on
        cycles = 0
        while not answered(grower, 0.2):
            cycles += 1
            assert cycles < 100, "the job did not go on"
            loop.cycle(float(cycles))
        assert grower.stdout is not None
        assert grower.stdout.readline() == "grown\n"
        assert cycles >= 160 * MIB // STEP - 1  # a step at a time, not all at once
        assert tier.limit() > tight
        squeeze.set(None)  # released: the limit back up first, then the killer
        loop.cycle(1000.0)
        assert tier.limit() == unlimited
        assert tier.oom() == {"oom_kill_disable": 0, "under_oom": 0, "oom_kill": 0}
        assert tier.oom(tier.container)["oom_kill"] == 0
        assert grower.poll() is None
        names = [Path(r["path"]).name for r in sink.named("cgroup_write")]
        assert names[0] == OOM_CONTROL
        assert names[-2:] == ["memory.limit_in_bytes", OOM_CONTROL]
    finally:
        stop(grower)
