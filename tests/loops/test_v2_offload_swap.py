"""Anonymous offloading and the swap limits above a container (cgroup v2, fake tree).

The kernel charges swap to a cgroup and every ancestor up to the root, and swaps out a cgroup's
anonymous memory only while each of them has room under its ``memory.swap.max``: a container
with ``max`` of its own under a pod or tier at ``0`` (or full) has no anonymous memory that
reclaim can take. Asking for it anyway makes ``memory.reclaim`` find the amount in file pages
(active ones too) or fail short after the kernel's retries.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.loops.offload_loop import OffloadLoop
from tests.support.builders import LEVEL
from tests.support.fakesys import MIB, FakeHost
from tests.support.offload import GIB, PRESSURE, pages, stat_text

UID = "0ff10ad0-0000-4000-8000-000000000000"


def offline_step(tmp_path: Path, swap_files: dict[str, dict[str, str]]) -> dict[str, object]:
    """The offload step of an offline container holding 100 MiB of inactive file cache and
    900 MiB of inactive anonymous memory on a node with swap and ``offload.anon`` on;
    ``swap_files``: by ``container``, ``pod`` or ``tier``, the swap files that cgroup has."""
    host = FakeHost(tmp_path, version=2, driver="systemd")
    (host.tier_dir("guaranteed") / "memory.reclaim").write_text("")
    (tmp_path / "proc/meminfo").write_text("MemTotal: 4194304 kB\nSwapTotal: 1048576 kB\n")
    pod = host.add_pod(UID, tier="besteffort", name="offline",
                       annotations={LEVEL: "reclaimed_cores"})
    container = pod.containers[0].rel
    d = host.cg("memory", container)
    (d / "memory.stat").write_text(stat_text(file=100 * MIB, ifile=100 * MIB, anon=GIB,
                                             ia=900 * MIB))
    (d / "memory.pressure").write_text(PRESSURE.format(some=0))
    (d / "memory.reclaim").write_text("")
    (d / "memory.swap.max").write_text("max\n")
    where = {"container": container, "pod": container.rsplit("/", 1)[0],
             "tier": host.tier_rel("besteffort")}
    for cgroup, files in swap_files.items():
        for name, text in files.items():
            (host.cg("memory", where[cgroup]) / name).write_text(text)
    base = Config()
    cfg = dataclasses.replace(base, offload=dataclasses.replace(base.offload, enabled=True,
                                                                anon=True))
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit)
    state = NodeState()
    state.replace_all(*host.nri())
    loop = OffloadLoop(lambda: cfg, state, sysfs, probe_host(sysfs), audit)
    loop.cycle(0.0)
    loop.cycle(5.0)
    (found,) = sink.named("offload_step")
    return found


@pytest.mark.parametrize("where", ["pod", "tier"])
def test_a_swap_max_of_zero_above_the_container_leaves_its_anonymous_memory_out(
        tmp_path: Path, where: str) -> None:
    found = offline_step(tmp_path, {where: {"memory.swap.max": "0\n"}})
    assert (found["anon"], found["asked_bytes"]) == (False, pages(5 * MIB))


def test_an_ancestor_whose_swap_is_full_leaves_the_anonymous_memory_out(
        tmp_path: Path) -> None:
    found = offline_step(tmp_path, {"tier": {"memory.swap.max": f"{256 * MIB}\n",
                                             "memory.swap.current": f"{256 * MIB}\n"}})
    assert (found["anon"], found["asked_bytes"]) == (False, pages(5 * MIB))


def test_room_under_every_swap_limit_above_keeps_the_anonymous_memory_in(
        tmp_path: Path) -> None:
    found = offline_step(tmp_path, {"tier": {"memory.swap.max": f"{256 * MIB}\n",
                                             "memory.swap.current": f"{MIB}\n"},
                                    "pod": {"memory.swap.max": "max\n"}})
    assert (found["anon"], found["asked_bytes"]) == (True, pages(50 * MIB))
