"""The ladder's squeeze on this machine's cgroup v1 kernel, against a job that grows its
anonymous memory: at a hard limit the kernel kills it, so the guard turns the tier's OOM killer
off before it writes the squeezed limit; the job then waits at the limit, goes on as the
guard's cycles raise it a step above the tier's anonymous memory, and nothing is killed. When
the squeeze ends the limit goes back up first, then the killer. The node is a
:class:`~tests.support.realroot.RealRoot` (a fresh child memcg of the machine's v1 hierarchy
with kubelet's tiers); skipped unless root on a host with the v1 memory controller."""

from __future__ import annotations

import dataclasses
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_guard import MemoryGuardLoop
from reconciler.loops.memory_squeeze import OOM_CONTROL, GuardSqueeze, Squeeze
from tests.support.realroot import RealRoot, end, in_cgroup, unavailable

UID = "66666666-0000-4000-8000-000000000006"
CID = "e" * 64
MIB = 1 << 20
STEP = 32 * MIB

pytestmark = [pytest.mark.real_kernel,
              pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "available")]

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
    real: RealRoot
    tier: Path
    container: Path

    def oom(self, memcg: Path | None = None) -> dict[str, int]:
        text = ((memcg or self.tier) / OOM_CONTROL).read_text()
        return {k: int(v) for k, v in (line.split() for line in text.splitlines())}

    def limit(self) -> int:
        return int((self.tier / "memory.limit_in_bytes").read_text())

    def spawn(self) -> subprocess.Popen[str]:
        grower = subprocess.Popen(in_cgroup(self.container, [sys.executable, "-I", "-c", GROWER]),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert grower.stdout is not None
        assert grower.stdout.readline() == "ready\n"
        # The kernel flushes memory.stat every 2 s or so: until then the tier's anonymous
        # memory reads short, and a squeeze computed from it falls below the usage.
        deadline = time.monotonic() + 10.0
        while self.anonymous() < 64 * MIB:
            assert time.monotonic() < deadline, "memory.stat never showed the job's memory"
            time.sleep(0.1)
        return grower

    def anonymous(self) -> int:
        stat = (self.tier / "memory.stat").read_text().splitlines()
        return int(dict(line.split() for line in stat)["total_rss"])


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[Tier]:
    with RealRoot(tmp_path, "squeeze", 1 << 30) as real:
        container, _ = real.container("besteffort", UID, CID)
        yield Tier(real, real.memcg / "kubepods/besteffort", container)


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
        end([grower], [])


def test_a_squeezed_tier_holds_a_growing_job_without_killing_it(tier: Tier) -> None:
    base = Config()
    cfg = dataclasses.replace(base, memory_guard=dataclasses.replace(
        base.memory_guard, standing_cap="never"))
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(str(tier.real.root), audit)
    squeeze = GuardSqueeze()
    loop = MemoryGuardLoop(lambda: cfg, sysfs, layout_for(sysfs), audit, squeeze)
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
        end([grower], [])
