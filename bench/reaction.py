"""Reaction time: memory-pressure onset to the agent's first mitigation, as a distribution.

For every onset a fresh agent is built by the agent's own composition root
(:func:`nri_plugin.agent.build_agent`, the background services of ``nri-qos run``) with the
default configuration, except where the host is (``reconciler.root``) and where the API server is
(a fake one on loopback, so the taint and the node condition are real API writes). Once it has
settled, pressure starts; the reaction is the time from the onset to the first write the ladder
causes (the taint, the node condition, the squeezed reclaimed tier, a wmark_ratio write or a
drop-cache write), taken from the audit trail on the same clock (CLOCK_MONOTONIC).

* **fake tree, PSI**: a fake ``/proc/pressure/memory`` whose stall counters start growing (40 %
  "some", 20 % "full") at the onset; the node's PSI path (the stall-counter poll there).
* **fake tree, free memory**: ``/proc/meminfo`` MemFree falls far below the watermark at the
  onset; the periodic detectors (``detection.interval_s``).
* **real kernel** (root and the cgroup v1 memory controller): the agent's cgroup root is a child
  memcg limited to 256 MiB (:mod:`tests.support.realroot`); a reclaimed pod in it streams a file
  larger than the limit through the page cache; the onset is the first charge that hits the limit
  (failcnt moves). ``--paths`` adds the same with ``memory.pressure_level`` switched off (what a
  host without it gets: the PSI path), with dirty page cache so that reclaim stalls. No online
  pod runs here, and by default only what online pods feel drives the ladder (their own PSI on
  cgroup v2, their refaults on cgroup v1 from Linux 5.9): the series therefore runs with
  ``mitigation.node_signals = on``, which lets the node's PSI (v2) and the memcg pressure events
  (v1) drive, and says so in its name.

The last line is ``reaction p50=<ms> ms p99=<ms> ms n=<count>`` for the default configuration on
the real kernel (``n=0`` where it cannot run).

    python bench/reaction.py [--onsets 50] [--paths] [--skip-fake] [--skip-real] [--json]
                             [--online-onsets 10] [--skip-online]
    python -m tests.vm --numa 2 --mem-mib 2048 --disk -- python bench/reaction.py --skip-fake
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.audit import AuditLog
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.agent import build_agent, probe
from nri_plugin.config.schema import ENFORCE, Config
from nri_plugin.config.store import ConfigStore
from nri_plugin.obs.logs import LoggingSetup
from nri_plugin.session.stub import PluginIdentity
from tests.support.fake_apiserver import FakeApiServer, write_kubeconfig
from tests.support.fakesys import GIB, FakeHost
from tests.support.guest_node import Node, pod_infos
from tests.support.polling import eventually
from tests.support.realroot import MIB, RealRoot, Worker, data_file, unavailable, unavailable_any

NODE = "bench-node"
ONLINE_UID = "5a5a5a5a-0000-4000-8000-000000000009"
SETTLE_S = 0.4
"""After the agent cleared leftovers: time for the first PSI sample and the event registrations."""
WAIT_S = 10.0
"""An onset without any action within this long counts as missed: free memory that falls with
no stall is read after up to ``detection.quiet_interval_s`` (5 s), then two samples."""


def first_write(event: str, fields: Mapping[str, Any]) -> bool:
    """Whether an audit record is a write the ladder caused."""
    if event in ("taint_added", "drop_cache_started"):
        return True
    if event == "node_condition":
        return fields.get("status") == "True"
    if event == "memory_guard_cap":
        return bool(fields.get("squeezed"))
    if event == "cgroup_write":
        return str(fields.get("reason", "")).startswith("tune memcg")
    return False


class Recorder:
    """An audit sink stamping each record with the monotonic clock as it arrives."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[tuple[float, str, dict[str, Any]]] = []

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None:
        with self.lock:
            self.records.append((time.monotonic(), event, dict(fields)))

    def after(self, t: float) -> list[tuple[float, str, dict[str, Any]]]:
        with self.lock:
            return [r for r in self.records if r[0] >= t]

    def count(self, event: str) -> int:
        with self.lock:
            return sum(1 for r in self.records if r[1] == event)


@dataclasses.dataclass
class Onset:
    reaction_ms: float | None
    path: str  # the detector whose reading raised the ladder
    action: str  # the first write
    taint_ms: float | None = None  # onset -> the taint on the node (two API requests)
    level_ms: float | None = None  # onset -> the ladder's level (its mitigation_level record)


def agent_config(root: Path, kubeconfig: Path, *, node_signals: str | None = None,
                 **detection: Any) -> Config:
    """The default configuration, enforcing (a first install only observes: no action to time);
    ``node_signals``: ``mitigation.node_signals`` when not its default."""
    cfg = Config()
    return dataclasses.replace(
        cfg,
        agent=dataclasses.replace(cfg.agent, mode=ENFORCE),
        reconciler=dataclasses.replace(cfg.reconciler, root=str(root)),
        kubernetes=dataclasses.replace(cfg.kubernetes, kubeconfig=str(kubeconfig),
                                       node_name=NODE),
        detection=dataclasses.replace(cfg.detection, **detection),
        mitigation=dataclasses.replace(
            cfg.mitigation, node_signals=node_signals or cfg.mitigation.node_signals),
    )


async def one_onset(cfg: Config, start: Callable[[], Awaitable[float | None]], *,
                    known: tuple[list[PodInfo], list[ContainerInfo]] | None = None) -> Onset:
    """Build and start an agent, let it settle, start pressure (``start`` returns the onset on
    the monotonic clock, or None when none happened), and wait for its first write.
    ``known``: the pods and containers the runtime reports to the agent."""
    recorder = Recorder()
    audit = AuditLog(recorder)
    host, sysfs = probe(cfg, audit)
    agent = build_agent(ConfigStore(audit, config=cfg), audit, host, sysfs,
                        PluginIdentity("nri-qos", "10"), run_background=True)
    if known is not None:
        agent.state.replace_all(*known)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(service(stop)) for service in agent.services]
    try:
        # the start's release of every rung (leftovers), then time to settle
        await eventually(lambda: recorder.count("mitigation_action") >= 4, WAIT_S)
        await asyncio.sleep(SETTLE_S)
        onset = await start()
        if onset is None:
            return Onset(None, "no onset", "")
        deadline = time.monotonic() + WAIT_S
        found: Onset | None = None
        while time.monotonic() < deadline:
            after = recorder.after(onset)
            writes = [r for r in after if first_write(r[1], r[2])]
            if writes and found is None:
                t, event, _ = writes[0]
                levels = [r for r in after if r[1] == "mitigation_level"]
                path = levels[0][2]["reason"].split(":", 1)[1].split()[0] if levels else "?"
                found = Onset((t - onset) * 1000, path, event,
                              level_ms=(levels[0][0] - onset) * 1000 if levels else None)
            taints = [r[0] for r in after if r[1] == "taint_added"]
            if found is not None and taints:
                found.taint_ms = (taints[0] - onset) * 1000
                return found
            await asyncio.sleep(0.005)
        return found or Onset(None, "missed", "")
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        agent.executor.shutdown(wait=False, cancel_futures=True)


# -- fake trees -----------------------------------------------------------------------------------

def fake_host(directory: Path) -> FakeHost:
    host = FakeHost(directory, version=1, driver="cgroupfs")
    host.set_numa([(40 * GIB, 64 * GIB, 4000)])
    (directory / "proc/vmstat").write_text("pgsteal_kswapd 0\npgscan_kswapd 0\n")
    write_pressure(directory, 0, 0)
    (directory / "proc/sys/vm").mkdir(parents=True, exist_ok=True)
    (directory / "proc/sys/vm/watermark_scale_factor").write_text("10\n")
    return host


def write_pressure(root: Path, some: int, full: int) -> None:
    path = root / "proc/pressure/memory"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".new")
    tmp.write_text(f"some avg10=0.00 avg60=0.00 avg300=0.00 total={some}\n"
                   f"full avg10=0.00 avg60=0.00 avg300=0.00 total={full}\n")
    os.replace(tmp, path)  # as the kernel's file: a reader never sees half of it


async def fake_psi(directory: Path, kubeconfig: Path) -> Onset:
    fake_host(directory)
    stalling = threading.Event()
    started: list[float] = []

    def kernel() -> None:
        """The stall counters, advancing as the kernel's do under pressure."""
        some = full = 0
        while not stalling.is_set():
            some += 4000  # 4 ms of 'some' stall per 10 ms
            full += 2000
            write_pressure(directory, some, full)
            if not started:
                started.append(time.monotonic())
            time.sleep(0.01)

    thread = threading.Thread(target=kernel)

    async def start() -> float:
        thread.start()
        await eventually(lambda: bool(started), WAIT_S, every_s=0.001)
        return started[0]

    try:
        return await one_onset(agent_config(directory, kubeconfig), start)
    finally:
        stalling.set()
        if thread.is_alive():
            thread.join()


async def fake_free(directory: Path, kubeconfig: Path) -> Onset:
    fake_host(directory)

    async def start() -> float:
        onset = time.monotonic()
        # 200 MiB free: under half of the 1 GiB watermark
        (directory / "proc/meminfo").write_text(
            f"MemTotal:       {64 * GIB // 1024} kB\nMemFree:        {200 * 1024} kB\n")
        return onset

    return await one_onset(agent_config(directory, kubeconfig), start)


# -- the real kernel ------------------------------------------------------------------------------

def pressure(worker: Worker, command: str) -> Callable[[], Awaitable[float | None]]:
    """A start for :func:`one_onset`: the pressure worker's ``command``, whose onset (the first
    charge that hits the limit) it returns in seconds of the monotonic clock."""
    async def start() -> float | None:
        answer = await asyncio.to_thread(worker.ask, command)
        onset = answer["onset"]
        return None if onset is None else onset / 1e9

    return start


async def real(directory: Path, kubeconfig: Path, data: Path, *, dirty: bool,
               seconds: float = 0.6, node_signals: str | None = None, **detection: Any) -> Onset:
    """One onset on the real kernel: ``seconds`` of pressure from the moment the limit is hit
    (what is timed is the first action after that moment, not the pressure's length)."""
    root = RealRoot(directory, "bench", 256 * MIB)
    try:
        memcg, _ = root.container("besteffort", "77777777-0000-4000-8000-000000000007", "d" * 64)
        worker: Worker = root.spawn_worker(memcg)
        command = (f"dirty {directory / 'dirty.bin'} {seconds} 256" if dirty
                   else f"read {data} {seconds}")
        return await one_onset(agent_config(root.root, kubeconfig, node_signals=node_signals,
                                            **detection), pressure(worker, command))
    finally:
        root.close()


async def online(directory: Path, kubeconfig: Path, **detection: Any) -> Onset:
    """One onset of an online pod's own stall in a cgroup v2 guest (the module doc)."""
    node = Node()
    try:
        cid = "e" * 64
        cgroup, cgroups_path = node.container("burstable", ONLINE_UID, cid)
        (cgroup / "memory.max").write_text(str(64 * MIB))
        worker = node.worker(cgroup, cgroup)
        return await one_onset(agent_config(Path("/"), kubeconfig, **detection),
                               pressure(worker, f"dirty {directory / 'online.bin'} 6.0 256"),
                               known=pod_infos(ONLINE_UID, "shared_cores", cid, cgroups_path,
                                               32 * MIB))
    finally:
        node.close()


# -- driving --------------------------------------------------------------------------------------

def percentiles(values: list[float]) -> tuple[float, float, float]:
    """p50, p90, p99 (inclusive quantiles)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[89], cuts[98]


def summary(name: str, onsets: list[Onset]) -> dict[str, Any]:
    times = sorted(o.reaction_ms for o in onsets if o.reaction_ms is not None)
    taints = sorted(o.taint_ms for o in onsets if o.taint_ms is not None)
    paths: dict[str, int] = {}
    actions: dict[str, int] = {}
    for o in onsets:
        paths[o.path] = paths.get(o.path, 0) + 1
        if o.action:
            actions[o.action] = actions.get(o.action, 0) + 1
    found: dict[str, Any] = {"name": name, "n": len(times), "missed": len(onsets) - len(times),
                             "paths": paths, "first_write": actions}
    if times:
        p50, p90, p99 = percentiles(times)
        found.update(p50=round(p50, 1), p90=round(p90, 1), p99=round(p99, 1),
                     min=round(times[0], 1), max=round(times[-1], 1))
    if taints:
        p50, _, p99 = percentiles(taints)
        found.update(taint_p50=round(p50, 1), taint_p99=round(p99, 1))
    levels = sorted(o.level_ms for o in onsets if o.level_ms is not None)
    if levels:
        p50, _, p99 = percentiles(levels)
        found.update(level_p50=round(p50, 1), level_p99=round(p99, 1))
    return found


def show(found: Mapping[str, Any]) -> None:
    if not found["n"]:
        print(f"{found['name']:<46} no reaction measured (missed {found['missed']})")
        return
    taint = (f"taint p50 {found['taint_p50']:.1f} p99 {found['taint_p99']:.1f}"
             if "taint_p50" in found else "taint -")
    level = (f"level p50 {found['level_p50']:.1f} p99 {found['level_p99']:.1f}"
             if "level_p50" in found else "level -")
    print(f"{found['name']:<46} p50 {found['p50']:7.1f}  p90 {found['p90']:7.1f}  "
          f"p99 {found['p99']:7.1f}  max {found['max']:7.1f} ms  n={found['n']} "
          f"missed={found['missed']}  ({level}; {taint})  via {found['paths']}  first "
          f"{found['first_write']}")


async def series(name: str, count: int, run: Callable[[Path], Awaitable[Onset]]) -> dict[str, Any]:
    [found] = await alternating(count, [(name, run)])
    return found


async def alternating(count: int, runs: list[tuple[str, Callable[[Path], Awaitable[Onset]]]]
                      ) -> list[dict[str, Any]]:
    """``count`` onsets of each run, one of each in turn (so that a machine whose speed drifts
    weighs on all alike); a summary of each."""
    onsets: list[list[Onset]] = [[] for _ in runs]
    for _ in range(count):
        for done, (_, run) in zip(onsets, runs, strict=True):
            with tempfile.TemporaryDirectory(prefix="nri-qos-reaction-") as tmp:
                done.append(await run(Path(tmp)))
    found = [summary(name, done) for done, (name, _) in zip(onsets, runs, strict=True)]
    for one in found:
        show(one)
    return found


async def main_async(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = []
    with FakeApiServer() as api, tempfile.TemporaryDirectory(prefix="nri-qos-bench-") as work:
        api.add_node(NODE)
        kubeconfig = write_kubeconfig(Path(work) / "kubeconfig", api.url)
        print(f"onset -> first mitigation write, default configuration, {args.onsets} onsets "
              "each (ms)")
        if not args.skip_fake:
            results.append(await series("fake tree: PSI stall counters",
                                        args.onsets, lambda d: fake_psi(d, kubeconfig)))
            results.append(await series("fake tree: free memory under the watermark",
                                        max(args.onsets // 5, 5),
                                        lambda d: fake_free(d, kubeconfig)))
        problem = unavailable_any()
        default: dict[str, Any] | None = None
        if args.skip_real or problem:
            print(f"real kernel: not measured ({problem or '--skip-real'})")
        else:
            data = data_file(Path(work) / "stream.bin", 512)
            if args.paths:
                results.append(await series(
                    "real kernel: PSI path only (no pressure_level)", max(args.onsets // 2, 10),
                    lambda d: real(d, kubeconfig, data, dirty=True,
                                   disabled=("pressure_level",))))
            # cgroup v2 has no memory.pressure_level: the node's PSI is the path, and clean
            # reads stall too little for it; dirty page cache makes reclaim wait for writeback,
            # for 2 s so that a slow machine still stalls a trigger's window's worth. By default
            # neither the node's PSI nor the memcg events drive (the online pods' own readings
            # do, and here no online pod runs): the series says it switches them on.
            dirty = bool(unavailable())
            default = await series(
                "real kernel, default configuration but mitigation.node_signals = on",
                args.onsets, lambda d: real(d, kubeconfig, data, dirty=dirty,
                                            seconds=2.0 if dirty else 0.6, node_signals="on"))
            results.append(default)
            if dirty and not args.skip_online:
                results.extend(await alternating(args.online_onsets, [
                    ("v2: an online pod's own stall, default configuration",
                     lambda d: online(d, kubeconfig)),
                    ("v2: the same, detection.quiet_interval_s = 1 s",
                     lambda d: online(d, kubeconfig, quiet_interval_s=1.0))]))
    if args.json:
        print(json.dumps(results, indent=2))
    if default and default["n"]:
        print(f"reaction p50={default['p50']:.1f} ms p99={default['p99']:.1f} ms "
              f"n={default['n']}")
    else:
        print("reaction p50=- ms p99=- ms n=0")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--onsets", type=int, default=50)
    parser.add_argument("--paths", action="store_true",
                        help="also the real kernel's PSI path alone (pressure_level off)")
    parser.add_argument("--skip-fake", action="store_true")
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--online-onsets", type=int, default=10,
                        help="on cgroup v2, onsets of an online pod's own stall per series")
    parser.add_argument("--skip-online", action="store_true",
                        help="on cgroup v2, not the online pod's own stall")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging = LoggingSetup(level="error")
    try:
        return asyncio.run(main_async(args))
    finally:
        logging.close()


if __name__ == "__main__":
    sys.exit(main())
