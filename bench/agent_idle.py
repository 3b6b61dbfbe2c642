"""What the agent costs on a node nothing presses: its CPU, its wake-ups and its memory, on this
machine.

A real ``nri-qos run`` process, registered with the runtime simulator and watching a fake API
server (a node without pods), reads this machine's real kernel files (``[reconciler] root`` is
``/``; observe mode, so it writes nothing). Two configurations in alternating rounds, so that
whatever else the machine does falls on both alike:

* ``creation``: detection and the ladder off (the colocation benchmark's ``agent-creation``:
  the creation answers, the memory guard, drift repair, NUMA binding and balance, the eviction
  round);
* ``agent``: the defaults, everything on.

After ``--settle`` seconds the process's CPU time (all threads, user and system) and its context
switches (voluntary ones are its wake-ups) are read over ``--window`` seconds, and its memory at
the end of it (anonymous, mapped files, peak resident set). As root, each round also starts the
agent in a memory cgroup of its own, after dropping the machine's page cache so that every round
reads its code from disk, and reads what the cgroup holds at the window's end (``cgroup MiB``:
the agent's pages and the page cache charged for what it read, as its pod is charged inside
``kubepods``). Prints the median of the rounds per configuration. ``--against SOURCE_TREE`` runs
the agent of that checkout too (``before``; this one is ``after``), in the same rounds, each
round in the other order.

    python bench/agent_idle.py [--rounds 3] [--settle 15] [--window 30] [--against TREE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_env import agent_command
from bench.colocation_agent import CREATION_ONLY
from nri_plugin.sim.simulator import RuntimeSimulator
from tests.support.fake_apiserver import FakeApiServer, write_kubeconfig
from tests.support.paths import REPO
from tests.support.processes import cpu_seconds
from tests.support.raw_runtime import status_kib
from tests.support.realroot import in_cgroup, memory_hierarchy, unavailable_any, usage

NODE_NAME = "idle-node"
READY_TIMEOUT_S = 60.0
# the process's memory at the end of the window, MiB: what it holds in anonymous pages (its
# heap, which reclaim cannot drop without swap), in mapped files, and its peak resident set
MEMORY = {"anon_mib": "RssAnon", "file_mib": "RssFile", "peak_mib": "VmHWM"}
CONFIGS = {
    "creation": CREATION_ONLY,
    "agent": "",
}


def switches(pid: int) -> tuple[int, int]:
    """Voluntary and involuntary context switches of every thread of ``pid``."""
    voluntary = involuntary = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key == "voluntary_ctxt_switches":
                voluntary += int(value)
            elif key == "nonvoluntary_ctxt_switches":
                involuntary += int(value)
    return voluntary, involuntary


@contextlib.contextmanager
def own_cgroup(name: str) -> Iterator[Path | None]:
    """A fresh memory cgroup for one round's agent, the page cache dropped first, removed when
    left; None where no memory cgroup can be made (not root)."""
    if unavailable_any():
        yield None
        return
    Path("/proc/sys/vm/drop_caches").write_text("3")
    cgroup = memory_hierarchy() / f"nriqos-idle-{name}-{os.getpid()}"
    cgroup.mkdir()
    try:
        yield cgroup
    finally:
        cgroup.rmdir()


async def one_round(name: str, work: Path, kubeconfig: Path, settle_s: float,
                    window_s: float, source: Path = REPO) -> dict[str, float]:
    config = work / f"{name}.toml"
    config.write_text(
        # kubelet's driver: a machine without kubelet cannot show it, and an agent that
        # cannot tell would wait for kubelet instead of running its loops
        f'[reconciler]\nstate_dir = "{work / "state"}"\ncgroup_driver = "cgroupfs"\n'
        f'[kubernetes]\nkubeconfig = "{kubeconfig}"\nnode_name = "{NODE_NAME}"\n'
        f'[status]\nsocket = "{work / "status.sock"}"\n' + CONFIGS[name])
    socket = work / "nri.sock"
    simulator = RuntimeSimulator(socket)
    await simulator.start()
    log = os.open(work / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    command, env = agent_command(source, work / "agent-env")
    argv = [*command, "run", "--config", str(config), "--socket", str(socket), "--log-level",
            "warning"]
    with own_cgroup(name) as cgroup:
        process = await asyncio.create_subprocess_exec(
            *(argv if cgroup is None else in_cgroup(cgroup, argv)), stdout=log, stderr=log,
            cwd=source, env=env)
        try:
            await simulator.wait_ready(timeout_s=READY_TIMEOUT_S)
            await asyncio.sleep(settle_s)
            cpu0, (vol0, inv0), threads = (cpu_seconds(process.pid), switches(process.pid),
                                           len(os.listdir(f"/proc/{process.pid}/task")))
            started = time.monotonic()
            await asyncio.sleep(window_s)
            elapsed = time.monotonic() - started
            cpu1, (vol1, inv1) = cpu_seconds(process.pid), switches(process.pid)
            memory = {key: status_kib(process.pid, field) / 1024 for key, field in MEMORY.items()}
            if cgroup is not None:
                memory["cgroup_mib"] = usage(cgroup) / (1 << 20)
        finally:
            process.terminate()
            await process.wait()
            os.close(log)
            await simulator.stop()
    return {"cpu_percent": (cpu1 - cpu0) / elapsed * 100, "wakeups_s": (vol1 - vol0) / elapsed,
            "preempted_s": (inv1 - inv0) / elapsed, "threads": float(threads), **memory}


async def run(rounds: int, settle_s: float, window_s: float,
              sources: dict[str, Path]) -> dict[str, list[dict[str, float]]]:
    """``sources``: the checkouts by label; results by ``<configuration>`` or, with more than
    one checkout, ``<configuration>@<label>``."""
    runs = [(name, label) for label in sources for name in CONFIGS]

    def key(name: str, label: str) -> str:
        return name if len(sources) == 1 else f"{name}@{label}"

    results: dict[str, list[dict[str, float]]] = {key(n, lb): [] for n, lb in runs}
    with tempfile.TemporaryDirectory(prefix="nriqos-idle-") as tmp, \
            FakeApiServer(poll_interval_s=0.5) as server:
        work = Path(tmp)
        server.add_node(NODE_NAME)
        kubeconfig = write_kubeconfig(work / "kubeconfig", server.url)
        for index in range(rounds):
            # ABBA...: no configuration (or checkout) always runs first
            for name, label in runs if index % 2 == 0 else reversed(runs):
                result = await one_round(name, work, kubeconfig, settle_s, window_s,
                                         sources[label])
                results[key(name, label)].append(result)
                print(f"round {index + 1} {key(name, label)}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in result.items()), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=15.0,
                        help="seconds after the agent registered before measuring")
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured")
    parser.add_argument("--against", type=Path, default=None, metavar="SOURCE_TREE",
                        help="also run the agent of this checkout (before; this one: after)")
    args = parser.parse_args()
    sources = {"after": REPO, "before": args.against.resolve()} if args.against else {"": REPO}
    results = asyncio.run(run(args.rounds, args.settle, args.window, sources))
    print(f"idle agent on this machine, {args.rounds} rounds of {args.window:g} s (median):")
    width = max(len(name) for name in results) + 1
    print(f"{'config':<{width}} {'CPU % of one core':>18} {'wake-ups/s':>11} "
          f"{'preempted/s':>12} {'threads':>8} {'anon MiB':>9} {'file MiB':>9} {'peak MiB':>9} "
          f"{'cgroup MiB':>11}")
    for name, rounds in results.items():
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"{name:<{width}} {med['cpu_percent']:>18.2f} {med['wakeups_s']:>11.1f} "
              f"{med['preempted_s']:>12.1f} {med['threads']:>8.0f} {med['anon_mib']:>9.1f} "
              f"{med['file_mib']:>9.1f} {med['peak_mib']:>9.1f} "
              f"{med.get('cgroup_mib', float('nan')):>11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
