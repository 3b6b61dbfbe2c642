"""Offloading on a real kernel: what an offline pod holds after a minute, with and without it.

Run it as root on a cgroup v2 machine whose ``TMPDIR`` is on a real filesystem (page cache
experiments cannot use tmpfs), for instance a guest of the tier::

    python -m tests.vm --numa 1 --mem-mib 3072 --disk -- python bench/offload.py

Each mode (``off``, then ``on``) starts, in kubelet's cgroup layout at ``/sys/fs/cgroup``:

* an offline pod (``reclaimed_cores``) whose process reads a 1 GiB file once (1 GiB of page
  cache charged to it that it never reads again) and then reads a 200 MiB file over and over
  (its working set), counting MiB read per second;
* an online pod (``shared_cores``) that serves a request every 10 ms (touching 64 pages of its
  128 MiB of anonymous memory and reading 64 KiB of a 64 MiB file), timing each one.

With ``on`` the offloading loop runs beside them with the default settings (``enabled = true``,
5 s period). After ``--seconds`` (60) it prints what the offline pod holds (``memory.current``),
its read rate over the run and the online pod's p99 latency. The two modes alternate
``--repeat`` times (3); the last line has the median of each figure::

    offload: held_mib off=… on=…; offline_rate off=… on=…; online_p99_ms off=… on=…
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.kubelet_node import remove_cgroup
from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.config.schema import Config
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.loops.offload_loop import OffloadLoop

CGROUP = Path("/sys/fs/cgroup")
CONTROLLERS = "+cpuset +cpu +io +memory +pids"
MIB = 1 << 20
LEVEL = "qos.nri-qos.io/level"

OFFLINE = (
    "import os, sys, time\n"
    "cold, hot, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])\n"
    "buf = bytearray(1 << 20)\n"
    "def read(path):\n"
    "    fd = os.open(path, os.O_RDONLY)\n"
    "    n = 0\n"
    "    while (got := os.readv(fd, [buf])):\n"
    "        n += got\n"
    "    os.close(fd)\n"
    "    return n\n"
    "read(cold)\n"
    "read(hot)\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "start = time.monotonic()\n"
    "done = 0\n"
    "while time.monotonic() - start < seconds:\n"
    "    done += read(hot)\n"
    "print(done / (1 << 20) / (time.monotonic() - start), flush=True)\n"
    "sys.stdin.readline()\n"
)
"""The offline job: the cold read, then MiB/s over its working set until the end."""

ONLINE = (
    "import os, random, sys, time\n"
    "data, seconds = sys.argv[1], float(sys.argv[2])\n"
    "heap = bytearray(128 << 20)\n"
    "for i in range(0, len(heap), 4096): heap[i] = 1\n"
    "fd = os.open(data, os.O_RDONLY)\n"
    "size = os.fstat(fd).st_size\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "start = time.monotonic()\n"
    "lat = []\n"
    "while time.monotonic() - start < seconds:\n"
    "    t = time.perf_counter()\n"
    "    for _ in range(64): heap[random.randrange(0, len(heap) >> 12) << 12] += 1\n"
    "    os.pread(fd, 65536, random.randrange(0, size - 65536))\n"
    "    lat.append(time.perf_counter() - t)\n"
    "    time.sleep(0.01)\n"
    "lat.sort()\n"
    "print(lat[int(0.99 * (len(lat) - 1))] * 1000, flush=True)\n"
    "sys.stdin.readline()\n"
)
"""The online service: the p99 of its requests, in ms."""


@dataclasses.dataclass
class Result:
    held_mib: float
    offline_rate: float
    online_p99_ms: float
    steps: int
    reclaimed_mib: float


def make_file(path: Path, mib: int) -> None:
    block = os.urandom(MIB)
    with path.open("wb") as out:
        for _ in range(mib):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())


def cgroup(rel: str) -> Path:
    path = CGROUP / rel
    path.mkdir(exist_ok=True)
    # As kubelet does: the QoS and pod levels pass the controllers down; a container is a leaf.
    if rel.count("/") < 2 or path.name.startswith("pod"):
        (path / "cgroup.subtree_control").write_text(CONTROLLERS)
    return path


def spawn(where: Path, script: str, *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        ["/bin/sh", "-c", 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"', "sh",
         str(where), sys.executable, "-I", "-c", script, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    if process.stdout.readline() != "ready\n":
        raise RuntimeError("a workload did not start")
    return process


def tell(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.write("go\n")
    process.stdin.flush()


def answer(process: subprocess.Popen[str]) -> float:
    assert process.stdout is not None
    return float(process.stdout.readline())


def run_mode(mode: str, data: Path, seconds: float) -> Result:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")
    made = [cgroup(rel) for rel in ("kubepods", "kubepods/burstable", "kubepods/besteffort")]
    uid_off, uid_on = f"0ff10ad0-0000-4000-8000-00000000000{mode == 'on':d}", \
        f"0ff10ad0-0000-4000-8000-10000000000{mode == 'on':d}"
    offline_pod = cgroup(f"kubepods/besteffort/pod{uid_off}")
    online_pod = cgroup(f"kubepods/burstable/pod{uid_on}")
    offline = cgroup(f"kubepods/besteffort/pod{uid_off}/{'a' * 64}")
    online = cgroup(f"kubepods/burstable/pod{uid_on}/{'b' * 64}")
    made += [offline_pod, online_pod, offline, online]
    workers = [spawn(offline, OFFLINE, str(data / "cold.bin"), str(data / "hot.bin"),
                     str(seconds)),
               spawn(online, ONLINE, str(data / "online.bin"), str(seconds))]
    sink = MemoryAuditSink()
    stop = threading.Event()
    driver = None
    if mode == "on":
        state = NodeState()
        state.replace_all(
            [PodInfo(id="sb-off", uid=uid_off, name="offline", namespace="bench",
                     cgroup_parent=f"/kubepods/besteffort/pod{uid_off}",
                     annotations={LEVEL: "reclaimed_cores"}),
             PodInfo(id="sb-on", uid=uid_on, name="online", namespace="bench",
                     cgroup_parent=f"/kubepods/burstable/pod{uid_on}",
                     annotations={LEVEL: "shared_cores"})],
            [ContainerInfo(id="a" * 64, pod_sandbox_id="sb-off", name="c",
                           cgroups_path=f"/kubepods/besteffort/pod{uid_off}/{'a' * 64}"),
             ContainerInfo(id="b" * 64, pod_sandbox_id="sb-on", name="c",
                           cgroups_path=f"/kubepods/burstable/pod{uid_on}/{'b' * 64}")])
        base = Config()
        cfg = dataclasses.replace(base, offload=dataclasses.replace(base.offload, enabled=True))
        sysfs = SysFs("/", AuditLog(sink))
        loop = OffloadLoop(lambda: cfg, state, sysfs, probe_host(sysfs), AuditLog(sink))

        def drive() -> None:
            while not stop.is_set():
                loop.cycle(time.monotonic())
                stop.wait(cfg.offload.interval_s)

        driver = threading.Thread(target=drive, daemon=True)
    try:
        for worker in workers:
            tell(worker)
        if driver is not None:
            driver.start()
        rate, p99 = (answer(w) for w in workers)
        held = int((offline / "memory.current").read_text()) / MIB
    finally:
        stop.set()
        if driver is not None:
            driver.join()
        for worker in workers:
            worker.kill()
            worker.wait()
        for path in reversed(made):
            remove_cgroup(path, within_s=10.0)
    steps = [r for r in sink.named("offload_step") if r["result"] in ("done", "short")]
    for record in sink.named("offload_step"):
        print(f"  step {record['verdict']:>9} {record['percent']:5.1f} % "
              f"asked {record['asked_bytes'] / MIB:7.1f} MiB reclaimed "
              f"{(record.get('reclaimed_bytes') or 0) / MIB:7.1f} MiB ({record['result']}; "
              f"stall {record['stall_us_per_s']} us/s, refault {record['refault_ratio']})")
    result = Result(held, rate, p99, len(steps),
                    sum((r.get("reclaimed_bytes") or 0) for r in steps) / MIB)
    print(f"{mode}: {result}", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0 or not (CGROUP / "cgroup.controllers").is_file():
        print("needs root on a cgroup v2 machine", file=sys.stderr)
        return 2
    results: dict[str, list[Result]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as directory:
        data = Path(directory)
        for name, mib in (("cold.bin", 1024), ("hot.bin", 200), ("online.bin", 64)):
            make_file(data / name, mib)
        for _ in range(args.repeat):
            for mode in ("off", "on"):
                results[mode].append(run_mode(mode, data, args.seconds))

    def median(mode: str, field: str) -> float:
        return float(statistics.median(getattr(r, field) for r in results[mode]))

    print(f"offload: held_mib off={median('off', 'held_mib'):.0f} "
          f"on={median('on', 'held_mib'):.0f}; "
          f"offline_rate off={median('off', 'offline_rate'):.0f} "
          f"on={median('on', 'offline_rate'):.0f}; "
          f"online_p99_ms off={median('off', 'online_p99_ms'):.2f} "
          f"on={median('on', 'online_p99_ms'):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
