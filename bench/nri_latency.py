"""CreateContainer round trips through a real unix socket (prints numbers; not a test).

The plugin daemon runs in a child process, as it does beside containerd; this process plays the
runtime with the simulator and sends the CreateContainer request recorded from containerd 2.4
(pod ``batch/cap-pod``), 5,000 times one after another and 5,000 times with 16 in flight.

usage: python bench/nri_latency.py [--all-hooks] [--calls N] [--log-level LEVEL]

``--all-hooks`` runs the chain with every capability enabled (resctrl on a fake resctrl tree in a
temporary directory, memory QoS, oom score, an OCI hook); the default is an empty chain. The
plugin logs its canonical line per event at ``--log-level`` (default info) to /dev/null.
Besides latency percentiles and throughput it prints the plugin process's CPU time per call
(from /proc), which does not depend on what else the machine is running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nri_plugin.envelope import decode_request  # noqa: E402
from nri_plugin.mux import MuxDecoder  # noqa: E402
from nri_plugin.simulator import RuntimeSimulator  # noqa: E402
from nri_plugin.stub import PLUGIN_SERVICE  # noqa: E402
from nri_plugin.ttrpc import FrameDecoder, MessageType  # noqa: E402

RECORDING = Path(os.environ.get(
    "NRI_CAPTURES_DIR", REPO.parent / "shared/nri-captures"
)) / "containerd-2.4-full-lifecycle.jsonl"
IN_FLIGHT = 16

ALL_HOOKS_CONFIG = """
[resctrl]
root = "{resctrl}"
[memory]
cgroup_version = "v2"
node_allocatable_bytes = "64Gi"
[memory.levels.shared_cores]
policy = "kubernetes"
[memory.levels.reclaimed_cores]
policy = "ratios"
min_ratio = 10
low_ratio = 50
high_ratio = 90
[oom.levels.shared_cores]
set_score = true
score = 500
[[oci_hooks.levels.reclaimed_cores.prestart]]
path = "/bin/true"
args = ["true"]
"""
EMPTY_CHAIN_CONFIG = "[resctrl]\nenabled = false\n"


def recorded_create_payload() -> bytes:
    """The ``CreateContainerRequest`` bytes containerd sent for batch/cap-pod."""
    mux = MuxDecoder()
    decoder = FrameDecoder()
    with RECORDING.open() as lines:
        for record in map(json.loads, lines):
            if record["dir"] != "r2p":
                continue
            for conn, payload in mux.feed(bytes.fromhex(record["hex"])):
                if conn != 1:
                    continue
                for frame in decoder.feed(payload):
                    request = decode_request(frame.data)
                    if frame.type == MessageType.REQUEST and request.method == "CreateContainer":
                        return bytes(request.payload)
    raise SystemExit(f"no CreateContainer request in {RECORDING}")


def fake_resctrl(root: Path) -> None:
    """An Intel-like resctrl tree: 11-way L3 and MB on two cache ids, 16 CLOSes."""
    (root / "info" / "L3").mkdir(parents=True)
    (root / "info" / "MB").mkdir(parents=True)
    (root / "schemata").write_text("L3:0=7ff;1=7ff\nMB:0=100;1=100\n")
    for name, value in {"cbm_mask": "7ff", "min_cbm_bits": "1", "num_closids": "16"}.items():
        (root / "info" / "L3" / name).write_text(value + "\n")
    for name, value in {"bandwidth_gran": "10", "min_bandwidth": "10", "num_closids": "16",
                        "delay_linear": "1"}.items():
        (root / "info" / "MB" / name).write_text(value + "\n")


def serve_plugin(socket_path: str, config_path: str, all_hooks: bool, log_level: str) -> None:
    """Child process: the real daemon, with an empty chain unless ``all_hooks``."""
    from nri_plugin import daemon

    async def run() -> int:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(15, stop.set)
        return await daemon.serve(config_path, socket_path, log_level, stop=stop,
                                  prelaunched=None, hooks=None if all_hooks else [])

    raise SystemExit(asyncio.run(run()))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(name: str, latencies: list[float], wall: float, plugin_cpu: float) -> str:
    ordered = sorted(latencies)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (f"{name:<14} p50 {p50 * 1e6:8.1f} us   p99 {p99 * 1e6:8.1f} us   "
            f"max {ordered[-1] * 1e6:8.1f} us   {len(ordered) / wall:7.0f} calls/s   "
            f"plugin CPU {plugin_cpu / len(ordered) * 1e6:6.1f} us/call")


async def measure(calls: int, all_hooks: bool, log_level: str) -> None:
    payload = recorded_create_payload()
    with tempfile.TemporaryDirectory(prefix="nri-bench-") as tmp:
        socket_path = Path(tmp) / "nri.sock"
        config_path = Path(tmp) / "config.toml"
        if all_hooks:
            fake_resctrl(Path(tmp) / "resctrl")
            config_path.write_text(ALL_HOOKS_CONFIG.format(resctrl=Path(tmp) / "resctrl"))
        else:
            config_path.write_text(EMPTY_CHAIN_CONFIG)
        simulator = RuntimeSimulator(socket_path)
        await simulator.start()
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--serve", str(socket_path), str(config_path),
            "--log-level", log_level, *(["--all-hooks"] if all_hooks else []),
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            connection = await simulator.wait_ready(timeout_s=30)
            peer = connection.peer
            assert peer is not None

            async def one() -> float:
                started = time.perf_counter()
                await peer.call(PLUGIN_SERVICE, "CreateContainer", payload, timeout_s=2)
                return time.perf_counter() - started

            for _ in range(200):
                await one()
            print(f"request: recorded CreateContainer, {len(payload)} bytes of payload; "
                  f"chain: {'all capabilities' if all_hooks else 'empty'}; "
                  f"plugin log level: {log_level}")

            cpu, started = cpu_seconds(child.pid), time.perf_counter()
            sequential = [await one() for _ in range(calls)]
            print(summary("sequential", sequential, time.perf_counter() - started,
                          cpu_seconds(child.pid) - cpu))

            concurrent: list[float] = []

            async def worker(count: int) -> None:
                for _ in range(count):
                    concurrent.append(await one())

            cpu, started = cpu_seconds(child.pid), time.perf_counter()
            share, extra = divmod(calls, IN_FLIGHT)
            await asyncio.gather(*(worker(share + (i < extra)) for i in range(IN_FLIGHT)))
            print(summary(f"{IN_FLIGHT} in flight", concurrent, time.perf_counter() - started,
                          cpu_seconds(child.pid) - cpu))
        finally:
            child.terminate()
            await child.wait()
            await simulator.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-hooks", action="store_true")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    parser.add_argument("--serve", nargs=2, metavar=("SOCKET", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_plugin(args.serve[0], args.serve[1], args.all_hooks, args.log_level)
    asyncio.run(measure(args.calls, args.all_hooks, args.log_level))


if __name__ == "__main__":
    main()
