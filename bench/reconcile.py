"""Reconciler cost per loop on fake host trees with 110, 500 and 1,000 pods (3 containers each).

Every third pod is a reclaimed (offline) pod of the BestEffort tier, the others online; each pod
has its ``memory.stat`` (and on cgroup v2 its ``memory.pressure``), each reclaimed container its
``memory.numa_stat``; two NUMA nodes with headroom, so nothing is pressed.

For each size the parent process builds a fake ``/sys`` + ``/proc`` + resctrl tree (by default on
tmpfs, closest to the kernel's in-memory cgroupfs) and a manifest of the pods; a child process
then loads only what the agent would hold (node state, loops) and measures, per loop:

* ``first``: the first cycle (everything to place or write),
* ``idle``: a cycle with nothing to change (median of several, wall and CPU time); for the task-id
  loop separately for the cheap cycles and the periodic full scan; the loops that run every second
  (detection, NUMA balance on cgroup v2, and the eviction round's reading of every pod's memory,
  ``eviction_facts``) matter most here,
* ``changed``: a cycle after 10 % of the containers were disturbed (new exec'd processes for the
  task-id loop, overwritten memory.high and oom_score_adj for drift, reset cpuset.mems for NUMA
  binding, a free-memory change for the guard; the per-second loops are measured idle only),

and the child's peak RSS (``ru_maxrss``). Drift keeps its notes in a state file as the agent does,
in a fresh directory under ``--state-dir`` (``/var/tmp`` by default: a disk, as the agent's
``/var/lib/nri-qos``, so its writes pay their fsyncs; ``""``: no state file). Prints one table;
``--json`` prints the raw numbers.

    python bench/reconcile.py [--sizes 110,500,1000] [--cgroup v1|v2] [--dir DIR]
                              [--state-dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.levels import LEVEL_NAMES, QosLevel
from hooks.model import ContainerInfo, PodInfo
from hooks.qos_level import QosConfig
from nri_plugin.config.schema import Config
from reconciler.detection.publisher import Publisher
from reconciler.detection.service import DetectorsLoop
from reconciler.detection.signals import Board
from reconciler.eviction.facts import pod_facts
from reconciler.host.cgroups import layout_for
from reconciler.host.probe import probe_host
from reconciler.host.resctrlfs import ResctrlFs, read_info
from reconciler.host.statefile import state_file
from reconciler.host.sysfs import SysFs
from reconciler.loops.base import Loop
from reconciler.loops.drift import DriftLoop
from reconciler.loops.memory_guard import MemoryGuardLoop
from reconciler.loops.numa_balance import NumaBalanceLoop
from reconciler.loops.numa_binding import NumaBindingLoop
from reconciler.loops.resctrl_tasks import ResctrlTasksLoop
from tests.support.fakesys import GIB, FakeHost

CONTAINERS = 3
THREADS = 4
SYSTEM_TASKS = 1500  # kernel threads and daemons in the root resctrl group
IDLE_RUNS = 9
TIERS = ("besteffort", "burstable", "guaranteed")
LOOPS = ("resctrl_tasks", "drift", "memory_guard", "numa_binding")
PER_SECOND = ("detection", "numa_balance", "eviction_facts")
POD_ANON = 256 << 20


# -- building (parent) ---------------------------------------------------------------------------

def build(root: Path, pods: int, version: int) -> None:
    driver = "systemd" if version == 2 else "cgroupfs"
    host = FakeHost(root, version=version, driver=driver, first_pid=10_000)
    host.set_numa([(48 * GIB, 96 * GIB, 20_000), (40 * GIB, 96 * GIB, 20_000)])
    host.set_tier_usage("besteffort", 8 * GIB, per_node=[4 * GIB, 4 * GIB])
    resctrl = host.make_resctrl()
    for level in LEVEL_NAMES:
        host.add_resctrl_group("nriqos-" + level)
    for i in range(pods):
        tier = TIERS[i % 3]
        annotations = {QosConfig().annotation: QosLevel.RECLAIMED_CORES.value} \
            if tier == "besteffort" else {}
        pod = host.add_pod(f"{i:08x}-0000-4000-8000-{i:012x}", tier=tier,
                           containers=CONTAINERS, threads=THREADS, memory_limit=2 * GIB,
                           memory_request=GIB, annotations=annotations)
        host.set_pod_anon(pod, POD_ANON)
        pod_dir = host.cg("memory", host.pod_rel(tier, pod.info.uid))
        if version == 2:
            (pod_dir / "memory.pressure").write_text(
                "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
        if tier == "besteffort":
            for c in pod.containers:
                host.set_container_numa(c, [POD_ANON // 4, POD_ANON // 12])
    system = list(range(2, 2 + SYSTEM_TASKS))
    for tid in system:
        host.add_system_task(tid)
    # Every task starts in the root group: the pods predate the plugin.
    (resctrl / "tasks").write_text("".join(f"{t}\n" for t in system + host.all_tids()))
    manifest = {
        "version": version,
        "system_tasks": system,
        "pods": [plain(p.info) for p in host.pods],
        "containers": [{**plain(c.info), "rel": c.rel, "pids": c.pids}
                       for p in host.pods for c in p.containers],
    }
    (root / "manifest.json").write_text(json.dumps(manifest))


def plain(obj: Any) -> dict[str, Any]:
    """A frozen view as JSON-able fields (mappings become dicts)."""
    return {f.name: dict(v) if isinstance(v := getattr(obj, f.name), Mapping) else v
            for f in dataclasses.fields(obj)}


# -- measuring (child) ---------------------------------------------------------------------------

def timed(fn: Callable[[], object]) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - w0) * 1e3, (time.process_time() - c0) * 1e3


def run_cycle(loop: Loop, now: float) -> tuple[float, float]:
    return timed(lambda: loop.cycle(now))


def median(samples: list[tuple[float, float]]) -> dict[str, float]:
    return {"wall_ms": round(statistics.median(s[0] for s in samples), 3),
            "cpu_ms": round(statistics.median(s[1] for s in samples), 3)}


def measure(root: Path, state_dir: str) -> dict[str, Any]:
    manifest = json.loads((root / "manifest.json").read_text())
    v2 = manifest["version"] == 2
    pods = [PodInfo(**p) for p in manifest["pods"]]
    extra = ("rel", "pids")
    containers = [ContainerInfo(**{k: v for k, v in c.items() if k not in extra})
                  for c in manifest["containers"]]
    cfg = Config()
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(root, audit)
    layout = layout_for(sysfs)
    mount = "/sys/fs/resctrl"
    resctrl = ResctrlFs(sysfs, mount, read_info(sysfs, mount, 2048), prefix="nriqos-",
                        audit=audit)
    state = NodeState()
    state.replace_all(pods, containers)

    def config() -> Config:
        return cfg

    loops: dict[str, Loop] = {
        "resctrl_tasks": ResctrlTasksLoop(config, state, sysfs, layout, resctrl, audit),
        "drift": DriftLoop(config, state, sysfs, layout, 64 << 30,
                           notes=state_file(state_dir) if state_dir else None),
        "memory_guard": MemoryGuardLoop(config, sysfs, layout, audit),
        "numa_binding": NumaBindingLoop(config, state, sysfs, layout, audit),
    }
    results: dict[str, Any] = {}
    clock = iter(range(1, 1_000_000))
    per_second: dict[str, Callable[[float], object]] = {
        "detection": DetectorsLoop(config, Publisher(Board(), audit, lambda: cfg.detection),
                                   state, sysfs, probe_host(sysfs), audit=audit).cycle,
        "numa_balance": NumaBalanceLoop(config, state, sysfs, layout, audit).cycle,
        "eviction_facts": lambda now: pod_facts(state.snapshot(), sysfs, layout),
    }
    for name, cycle in per_second.items():
        samples = [timed(functools.partial(cycle, float(next(clock))))
                   for _ in range(IDLE_RUNS + 1)]
        results[name] = {"first": median(samples[:1]), "idle": median(samples[1:])}
    full_every = cfg.reconciler.full_scan_every
    for name, loop in loops.items():
        entry: dict[str, Any] = {}
        entry["first"] = median([run_cycle(loop, float(next(clock)))])
        if name == "resctrl_tasks":
            # The kernel takes a moved task out of its old group; a plain file cannot, so the
            # root group's list is reset to what the kernel would show now.
            (root / "sys/fs/resctrl/tasks").write_text(
                "".join(f"{t}\n" for t in manifest["system_tasks"]))
        cheap: list[tuple[float, float]] = []
        full: list[tuple[float, float]] = []
        runs = IDLE_RUNS * full_every if name == "resctrl_tasks" else IDLE_RUNS
        for i in range(runs):
            sample = run_cycle(loop, float(next(clock)))
            # the first cycle was a full scan: cycles 1, 2, ... are cheap until full_every
            (full if name == "resctrl_tasks" and (i + 1) % full_every == 0 else cheap).append(
                sample)
        entry["idle"] = median(cheap)
        if full:
            entry["idle_full_scan"] = median(full)
        changed = []
        for round_ in range(3):
            disturb(name, root, manifest, v2, round_)
            changed.append(run_cycle(loop, float(next(clock))))
        entry["changed_10pct"] = median(changed)
        results[name] = entry
    results["writes"] = len(sink.named("cgroup_write"))
    results["tasks_moved"] = sum(r["count"] for r in sink.named("tasks_moved"))
    results["ru_maxrss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return results


def disturb(loop: str, root: Path, manifest: dict[str, Any], v2: bool, round_: int) -> None:
    """Change 10 % of the containers the way the loop would notice."""
    containers = manifest["containers"][round_ % 10::10]
    cg = root / "sys/fs/cgroup"
    if loop == "resctrl_tasks":
        new: list[int] = []
        for n, c in enumerate(containers):
            tid = 5_000_000 + round_ * 100_000 + n
            new.append(tid)
            d = cg / c["rel"] if v2 else cg / "cpu" / c["rel"]
            with open(d / ("cgroup.threads" if v2 else "tasks"), "a") as f:
                f.write(f"{tid}\n")
            proc = root / "proc" / str(tid)
            proc.mkdir(exist_ok=True)
            (proc / "cgroup").write_text(f"0::/{c['rel']}\n" if v2
                                         else f"4:cpu,cpuacct:/{c['rel']}\n")
        with open(root / "sys/fs/resctrl/tasks", "a") as f:
            f.write("".join(f"{t}\n" for t in new))
    elif loop == "drift":
        for c in containers:
            for pid in c["pids"]:
                (root / "proc" / str(pid) / "oom_score_adj").write_text("0\n")
            if v2:
                (cg / c["rel"] / "memory.high").write_text("max\n")
    elif loop == "numa_binding":
        for c in containers:
            (cg / ("" if v2 else "cpuset") / c["rel"] / "cpuset.mems").write_text("0-1\n")
    elif loop == "memory_guard":
        free = (30 + round_) * GIB
        (root / "sys/devices/system/node/node0/meminfo").write_text(
            f"Node 0 MemTotal: {96 * GIB // 1024} kB\nNode 0 MemFree: {free // 1024} kB\n")


# -- driver --------------------------------------------------------------------------------------

def cell(entry: dict[str, float] | None, key: str) -> str:
    """A table cell: the figure in ms, or blank where the loop was not measured that way."""
    return "" if entry is None else f"{entry[key]:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="110,500,1000")
    parser.add_argument("--cgroup", choices=("v1", "v2"), default="v1")
    parser.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    parser.add_argument("--state-dir", default="/var/tmp")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--notes", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure), args.notes)))
        return 0
    version = 2 if args.cgroup == "v2" else 1
    report: dict[int, Any] = {}
    for pods in (int(s) for s in args.sizes.split(",")):
        root = Path(tempfile.mkdtemp(prefix="nriqos-bench-", dir=args.dir))
        notes = tempfile.mkdtemp(prefix="nriqos-bench-state-", dir=args.state_dir) \
            if args.state_dir else ""
        try:
            build(root, pods, version)
            child = subprocess.run([sys.executable, __file__, "--measure", str(root),
                                    "--notes", notes], capture_output=True, text=True)
            if child.returncode != 0:
                sys.stderr.write(child.stderr)
                return 1
            # The loops' log lines come first; the figures are the last line.
            report[pods] = json.loads(child.stdout.splitlines()[-1])
        finally:
            shutil.rmtree(root, ignore_errors=True)
            if notes:
                shutil.rmtree(notes, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"cgroup {args.cgroup}, {CONTAINERS} containers x {THREADS} threads per pod, "
          f"{SYSTEM_TASKS} system tasks, tree on {args.dir or 'the default temp dir'}, "
          f"drift's state file {'under ' + args.state_dir if args.state_dir else 'none'}")
    print(f"{'pods':>5} {'loop':<14} {'first':>8} {'idle wall':>10} {'idle cpu':>9} "
          f"{'full wall':>10} {'full cpu':>9} {'10% wall':>9} {'10% cpu':>8}")
    for pods, res in report.items():
        for name in LOOPS + PER_SECOND:
            e = res[name]
            full = e.get("idle_full_scan")
            changed = e.get("changed_10pct")
            full_wall, full_cpu = cell(full, "wall_ms"), cell(full, "cpu_ms")
            print(f"{pods:>5} {name:<14} {e['first']['wall_ms']:>8.1f} "
                  f"{e['idle']['wall_ms']:>10.3f} {e['idle']['cpu_ms']:>9.3f} "
                  f"{full_wall:>10} {full_cpu:>9} "
                  f"{cell(changed, 'wall_ms'):>9} {cell(changed, 'cpu_ms'):>8}")
        print(f"{pods:>5} peak RSS {res['ru_maxrss_mb']} MB; writes {res['writes']}, "
              f"task ids moved {res['tasks_moved']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
