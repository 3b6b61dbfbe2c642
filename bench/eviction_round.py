"""What an eviction round costs, and how long an out-of-tree plugin call takes.

* ``round``: wall time of :meth:`EvictionManager.run_round` on a fake host tree (cgroup v1) with
  110 and 500 running pods, the four in-tree plugins reading a board where every reclaimed pod is
  over its RSS threshold and the system pressure is hard-met, in dry-run (no API): each round reads
  every pod's ``memory.stat``, asks the plugins, filters, ranks and rate-limits. p50/p99 over the
  rounds.
* ``grpc``: one plugin process (``tests/support/eviction_plugin.py``) on a unix socket; wall time
  of each call (ThresholdMet, GetEvictPods with 110 pods, GetTopEvictionPods) from the manager's
  client, p50/p99.

    python bench/eviction_round.py [--rounds 200] [--calls 300]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.detection.counting import Counting
from reconciler.detection.signals import Board, Level, Reading, pod_scope
from reconciler.eviction.api import ActivePod
from reconciler.eviction.builtin import in_tree_plugins
from reconciler.eviction.config import EvictionConfig
from reconciler.eviction.manager import EvictionManager
from reconciler.eviction.remote_plugin import RemotePlugin
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.sysfs import SysFs
from reconciler.kube import KubeActions, KubernetesConfig
from tests.support.fakesys import GIB, FakeHost

REPO = Path(__file__).resolve().parents[1]


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"p50={p50 * 1000:.3f} ms p99={p99 * 1000:.3f} ms n={len(ordered)}"


async def bench_rounds(pods: int, rounds: int, tmp: Path) -> str:
    host = FakeHost(tmp / f"host-{pods}")
    board = Board()
    readings = []
    for i in range(pods):
        tier = "besteffort" if i % 2 else "burstable"
        level = "reclaimed_cores" if i % 2 else "shared_cores"
        pod = host.add_pod(f"{i:08d}-0000-0000-0000-000000000000", tier=tier,
                           annotations={"qos.nri-qos.io/level": level}, memory_request=GIB)
        host.set_pod_anon(pod, 2 * GIB)
        readings.append(Reading("rss_overuse", pod_scope(pod.info.uid), Level.HIGH, 2 * GIB,
                                1.05 * GIB, "bytes", pod_uid=pod.info.uid))
    board.publish("rss_overuse", readings)
    board.publish("system_free", [Reading("system_free", "node", Level.HIGH, 1, 2, "bytes")])
    state = NodeState()
    state.replace_all(*host.nri())
    cfg = dataclasses.replace(Config(), eviction=EvictionConfig(
        plugin_dir=str(tmp / "none"), met_rounds=1, reevict_after_s=1.0))
    audit = AuditLog(MemoryAuditSink())
    clock = [0.0]
    manager = EvictionManager(
        lambda: cfg, state, KubeActions(None, KubernetesConfig(), audit), "node", audit,
        SysFs(host.root), CgroupLayout(1, "cgroupfs"),
        in_tree_plugins(board, lambda: cfg.eviction, Counting), clock=lambda: clock[0])
    samples = []
    for _ in range(rounds):
        # Past the re-eviction window every round: each round decides afresh.
        clock[0] += 2.0
        started = time.perf_counter()
        await manager.run_round()
        samples.append(time.perf_counter() - started)
    await manager.close()
    return f"round pods={pods}: {percentiles(samples)}"


async def bench_grpc(calls: int, tmp: Path) -> list[str]:
    socket_path = tmp / "bench.sock"
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.eviction_plugin", str(socket_path), "normal",
        "--met", "hard", "--evict", "x", cwd=REPO, stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    await child.stdout.readline()
    plugin = RemotePlugin("bench", str(socket_path), lambda: 1.0)
    active = [ActivePod(f"uid-{i}", "ns", f"pod-{i}", "reclaimed_cores", 0, GIB, GIB)
              for i in range(110)]
    lines = []
    try:
        for name, call in (("ThresholdMet", plugin.threshold_met),
                           ("GetEvictPods", lambda: plugin.get_evict_pods(active)),
                           ("GetTopEvictionPods",
                            lambda: plugin.get_top_eviction_pods(active, 1, "x"))):
            await call()  # connect and warm up
            samples = []
            for _ in range(calls):
                started = time.perf_counter()
                await call()
                samples.append(time.perf_counter() - started)
            lines.append(f"grpc {name}: {percentiles(samples)}")
    finally:
        await plugin.close()
        child.kill()
        await child.wait()
    return lines


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nri-qos-evict-bench-") as tmp:
        for pods in (110, 500):
            print(await bench_rounds(pods, args.rounds, Path(tmp)), flush=True)
        for line in await bench_grpc(args.calls, Path(tmp)):
            print(line, flush=True)


if __name__ == "__main__":
    asyncio.run(main())
