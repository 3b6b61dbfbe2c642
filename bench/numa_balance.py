"""NUMA balance on a real two-node kernel: how long a node filled by an offline pod stays under
its watermark, with the balance on and off, and how long each step takes.

Runs in a guest of two NUMA nodes on cgroup v2 (root; the kubelet-like layout of
:mod:`tests.support.guest_node` on the guest's /sys/fs/cgroup)::

    python -m tests.vm --numa 2 --mem-mib 2048 --disk -- python bench/numa_balance.py

For each mode a fresh offline (``reclaimed_cores``) pod bound to node 0 fills node 0 until its
free memory is ``--under-mib`` below its watermark (the default configuration's: the memory
guard's floor of 10 % of the node), then the NUMA loops run on their default configuration and
periods until node 0 is back at its watermark or ``--window-s`` passed:

* ``off``: neither binding nor balance: the pod's pages stay where they are;
* ``bind``: the binding alone (the balance off): node 0 leaves the pod's ``cpuset.mems`` and the
  kernel moves every page in that one write;
* ``on``: binding and balance (the defaults): steps of at most 64 MiB under a 5 s deadline.

The last line is ``numa balance: recovered_s off=<s> on=<s>; moved_mib=<MiB>;
max_step_ms=<ms>`` (``>window`` where node 0 did not recover); the line before it gives the
binding alone, whose one write is its only step.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import read_nodes
from reconciler.host.sysfs import SysFs
from reconciler.host.values import PAGE_SIZE
from reconciler.loops.numa_balance import NumaBalanceLoop
from reconciler.loops.numa_binding import NumaBindingLoop
from tests.support.guest_node import MIB, Node

UID = "4e4e4e4e-0000-4000-8000-0000000000e1"
CID = "e" * 64


def headroom(cfg: Config, sysfs: SysFs, node: int) -> int:
    guard = cfg.memory_guard
    [found] = [n for n in read_nodes(sysfs, PAGE_SIZE) if n.id == node]
    return found.headroom(guard.watermark_floor_bytes, guard.watermark_scale_factor,
                          guard.watermark_floor_percent)


def run(mode: str, under_mib: int, window_s: float) -> tuple[float | None, int, float]:
    """Seconds until node 0 recovered (None: not within the window), bytes the steps moved,
    and the longest step in seconds (the binding's write, for ``bind``)."""
    base = Config()
    cfg = dataclasses.replace(
        base, numa=dataclasses.replace(base.numa, enabled=mode != "off"),
        numa_balance=dataclasses.replace(base.numa_balance, enabled=mode == "on"))
    node = Node()
    try:
        cgroup, path = node.container("besteffort", UID, CID)
        (cgroup / "cpuset.mems").write_text("0")
        sysfs = SysFs("/")
        fill = (headroom(cfg, sysfs, 0) + under_mib * MIB) // MIB
        holder = node.holder(cgroup, fill)
        assert headroom(cfg, sysfs, 0) < 0, "node 0 is not under its watermark"
        assert headroom(cfg, sysfs, 1) > 0, "node 1 has no room"
        state = NodeState()
        state.replace_all(
            [PodInfo(id="sb", uid=UID, name="batch", namespace="bench",
                     cgroup_parent=f"/kubepods/besteffort/pod{UID}",
                     annotations={"qos.nri-qos.io/level": "reclaimed_cores"})],
            [ContainerInfo(id=CID, pod_sandbox_id="sb", name="c", cgroups_path=path)])
        sink = MemoryAuditSink()
        audit = AuditLog(sink)
        sysfs = SysFs("/", audit)
        layout = layout_for(sysfs)
        binding = NumaBindingLoop(lambda: cfg, state, sysfs, layout, audit)
        balance = NumaBalanceLoop(lambda: cfg, state, sysfs, layout, audit)
        started = time.monotonic()
        next_binding = next_balance = started
        longest = 0.0
        recovered: float | None = None
        while time.monotonic() - started < window_s:
            now = time.monotonic()
            if now >= next_binding:
                binding.cycle(now)
                longest = max(longest, time.monotonic() - now) if mode == "bind" else longest
                next_binding = now + cfg.numa.interval_s
            if now >= next_balance:
                balance.cycle(now)
                next_balance = now + cfg.numa_balance.interval_s
            if headroom(cfg, sysfs, 0) >= 0:
                recovered = time.monotonic() - started
                break
            time.sleep(0.05)
        steps = sink.named("numa_balance_step")
        if steps:
            longest = max(float(s["duration_s"]) for s in steps)
        moved = sum(int(s["moved_bytes"]) for s in steps)
        print(f"{mode}: recovered_s={recovered if recovered is None else round(recovered, 2)} "
              f"steps={len(steps)} moved_mib={moved // MIB} longest_ms={longest * 1000:.0f} "
              f"results={sorted({s['result'] for s in steps})}", flush=True)
        holder.kill()
        holder.wait()
        return recovered, moved, longest
    finally:
        node.close()


def shown(value: float | None, window_s: float) -> str:
    return f">{window_s:g}" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--under-mib", type=int, default=100,
                        help="how far node 0 is filled below its watermark (default 100)")
    parser.add_argument("--window-s", type=float, default=30.0,
                        help="how long each mode may take to recover (default 30)")
    args = parser.parse_args()
    # The loops' debug lines (each wait for the rate limit) would bury the results.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    off, _, _ = run("off", args.under_mib, args.window_s)
    bind, _, bind_step = run("bind", args.under_mib, args.window_s)
    on, moved, longest = run("on", args.under_mib, args.window_s)
    deadline = Config().numa_balance.step_deadline_s
    print(f"numa binding alone: recovered_s={shown(bind, args.window_s)}; "
          f"one write of {bind_step * 1000:.0f} ms")
    print(f"numa balance: recovered_s off={shown(off, args.window_s)} "
          f"on={shown(on, args.window_s)}; moved_mib={moved // MIB}; "
          f"max_step_ms={longest * 1000:.0f} (deadline {deadline * 1000:.0f})")
    return 0 if on is not None and longest <= deadline else 1


if __name__ == "__main__":
    sys.exit(main())
