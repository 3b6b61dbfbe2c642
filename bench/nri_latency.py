"""CreateContainer round trips through a real unix socket (prints numbers; not a test).

The plugin daemon runs in a child process, as it does beside containerd. This process plays the
runtime and sends the CreateContainer request recorded from containerd 2.4 (pod
``batch/cap-pod``), 5,000 times one after another and 5,000 times with 16 in flight, twice:

* ``minimal runtime``: a blocking socket and the sans-IO codecs, a few microseconds per call, so
  the figures are the plugin's own plus the kernel's (containerd's Go client is as cheap). This
  is the figure the latency target applies to.
* ``simulator``: the asyncio runtime simulator (``nri-qos simulate``), whose own Python work
  (about as much as the plugin's transport) is in the figures too.

usage: python bench/nri_latency.py [--all-capabilities] [--calls N] [--log-level LEVEL]

``--all-capabilities`` (formerly ``--all-hooks``, still accepted) runs the chain with every
capability enabled (resctrl on a fake resctrl tree in a temporary directory, memory QoS, oom
score, an OCI hook); the default is an empty chain. The plugin logs its canonical line per
event at ``--log-level`` (default info) to /dev/null. Besides latency percentiles and throughput
it prints the plugin process's CPU time per call (from /proc), which does not depend on what else
the machine is running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nri_plugin.sim.simulator import RuntimeSimulator  # noqa: E402
from nri_plugin.wire.envelope import (  # noqa: E402
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from nri_plugin.wire.mux import (  # noqa: E402
    PLUGIN_SERVICE_CONN,
    RUNTIME_SERVICE_CONN,
    Demultiplexer,
    MuxDecoder,
    encode_message,
)
from nri_plugin.wire.nri_api import PLUGIN_SERVICE  # noqa: E402
from nri_plugin.wire.ttrpc import Frame, FrameDecoder, MessageType, encode_frame  # noqa: E402
from protos import nri_api_pb2 as api  # noqa: E402
from tests.support.processes import cpu_seconds  # noqa: E402

RECORDING = Path(os.environ.get(
    "NRI_CAPTURES_DIR", REPO.parent / "shared/nri-captures"
)) / "containerd-2.4-full-lifecycle.jsonl"
IN_FLIGHT = 16

# The background reconciler stays off: these figures are the NRI path's. So does the status
# socket, which would take the node agent's path; the metrics are recorded all the same.
ALL_CAPABILITIES_CONFIG = """
[reconciler]
enabled = false
[status]
enabled = false
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
EMPTY_CHAIN_CONFIG = """
[reconciler]
enabled = false
[status]
enabled = false
[resctrl]
enabled = false
[memory]
enabled = false
[oom]
enabled = false
"""


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


def serve_plugin(socket_path: str, config_path: str, log_level: str) -> None:
    """Child process: the real daemon, its capabilities as the config file says."""
    from nri_plugin.cli import daemon

    async def run() -> int:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(15, stop.set)
        return await daemon.serve(config_path, socket_path, log_level, stop=stop,
                                  prelaunched=None)

    raise SystemExit(asyncio.run(run()))



def summary(name: str, latencies: list[float], wall: float, plugin_cpu: float) -> str:
    ordered = sorted(latencies)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (f"{name:<30} p50 {p50 * 1e6:7.1f} us   p99 {p99 * 1e6:7.1f} us   "
            f"max {ordered[-1] * 1e6:8.1f} us   {len(ordered) / wall:6.0f} calls/s   "
            f"plugin CPU {plugin_cpu / len(ordered) * 1e6:6.1f} us/call")


@contextmanager
def plugin_files(all_capabilities: bool) -> Iterator[tuple[Path, Path]]:
    """(socket path, config path) in a fresh temporary directory (with a fake resctrl tree)."""
    with tempfile.TemporaryDirectory(prefix="nri-bench-") as tmp:
        config_path = Path(tmp) / "config.toml"
        if all_capabilities:
            fake_resctrl(Path(tmp) / "resctrl")
            config_path.write_text(ALL_CAPABILITIES_CONFIG.format(resctrl=Path(tmp) / "resctrl"))
        else:
            config_path.write_text(EMPTY_CHAIN_CONFIG)
        yield Path(tmp) / "nri.sock", config_path


def plugin_command(socket_path: Path, config_path: Path, all_capabilities: bool,
                   log_level: str) -> list[str]:
    return [sys.executable, __file__, "--serve", str(socket_path), str(config_path),
            "--log-level", log_level, *(["--all-capabilities"] if all_capabilities else [])]


class MinimalRuntime:
    """The runtime's end of one plugin connection, on a blocking socket.

    Answers the plugin's RegisterPlugin, sends Configure and an empty Synchronize, then calls.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._demux = Demultiplexer()
        self._frames: list[tuple[int, Frame]] = []
        self._next_stream = 1

    def _frame(self) -> tuple[int, Frame]:
        while not self._frames:
            data = self._sock.recv(1 << 16)
            if not data:
                raise SystemExit("the plugin closed the connection")
            self._frames.extend(self._demux.feed(data))
        return self._frames.pop(0)

    def handshake(self) -> None:
        conn, frame = self._frame()
        if conn != RUNTIME_SERVICE_CONN or decode_request(frame.data).method != "RegisterPlugin":
            raise SystemExit(f"expected RegisterPlugin, got a frame on connection {conn}")
        self._sock.sendall(encode_message(RUNTIME_SERVICE_CONN, encode_frame(
            frame.stream_id, MessageType.RESPONSE, encode_response())))
        configure = api.ConfigureRequest(runtime_name="containerd", runtime_version="2.4.0",
                                         NRI_version="v0.12.0", request_timeout=2000,
                                         registration_timeout=5000)
        for method, message in (("Configure", configure), ("Synchronize",
                                                             api.SynchronizeRequest())):
            self.send(method, message.SerializeToString())
            self.receive()

    def send(self, method: str, payload: bytes) -> int:
        """Send one request; its stream id."""
        stream_id, self._next_stream = self._next_stream, self._next_stream + 2
        request = encode_request(PLUGIN_SERVICE, method, payload, 2_000_000_000)
        self._sock.sendall(encode_message(PLUGIN_SERVICE_CONN, encode_frame(
            stream_id, MessageType.REQUEST, request)))
        return stream_id

    def receive(self) -> int:
        """Wait for the next answer (it must be OK); its stream id."""
        conn, frame = self._frame()
        reply = decode_response(frame.data)
        if conn != PLUGIN_SERVICE_CONN or not reply.ok:
            raise SystemExit(f"unexpected answer on connection {conn}: {reply}")
        return frame.stream_id


def measure_minimal(payload: bytes, calls: int, all_capabilities: bool, log_level: str) -> None:
    with plugin_files(all_capabilities) as (socket_path, config_path), \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(socket_path))
        listener.listen(1)
        listener.settimeout(30)
        command = plugin_command(socket_path, config_path, all_capabilities, log_level)
        child = subprocess.Popen(command, stderr=subprocess.DEVNULL)
        try:
            sock, _ = listener.accept()
            with sock:
                sock.settimeout(10)
                runtime = MinimalRuntime(sock)
                runtime.handshake()

                def one() -> float:
                    started = time.perf_counter()
                    runtime.send("CreateContainer", payload)
                    runtime.receive()
                    return time.perf_counter() - started

                for _ in range(200):
                    one()
                cpu, started = cpu_seconds(child.pid), time.perf_counter()
                sequential = [one() for _ in range(calls)]
                print(summary("minimal runtime, sequential", sequential,
                              time.perf_counter() - started, cpu_seconds(child.pid) - cpu))

                sent: dict[int, float] = {}
                concurrent: list[float] = []
                cpu, started = cpu_seconds(child.pid), time.perf_counter()
                for _ in range(min(IN_FLIGHT, calls)):
                    sent[runtime.send("CreateContainer", payload)] = time.perf_counter()
                while sent:
                    stream_id = runtime.receive()
                    concurrent.append(time.perf_counter() - sent.pop(stream_id))
                    if len(concurrent) + len(sent) < calls:
                        sent[runtime.send("CreateContainer", payload)] = time.perf_counter()
                print(summary(f"minimal runtime, {IN_FLIGHT} in flight", concurrent,
                              time.perf_counter() - started, cpu_seconds(child.pid) - cpu))
        finally:
            child.terminate()
            child.wait()


async def measure_simulator(payload: bytes, calls: int, all_capabilities: bool,
                            log_level: str) -> None:
    with plugin_files(all_capabilities) as (socket_path, config_path):
        simulator = RuntimeSimulator(socket_path)
        await simulator.start()
        child = await asyncio.create_subprocess_exec(
            *plugin_command(socket_path, config_path, all_capabilities, log_level),
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
            cpu, started = cpu_seconds(child.pid), time.perf_counter()
            sequential = [await one() for _ in range(calls)]
            print(summary("simulator, sequential", sequential, time.perf_counter() - started,
                          cpu_seconds(child.pid) - cpu))

            concurrent: list[float] = []

            async def worker(count: int) -> None:
                for _ in range(count):
                    concurrent.append(await one())

            cpu, started = cpu_seconds(child.pid), time.perf_counter()
            share, extra = divmod(calls, IN_FLIGHT)
            await asyncio.gather(*(worker(share + (i < extra)) for i in range(IN_FLIGHT)))
            print(summary(f"simulator, {IN_FLIGHT} in flight", concurrent,
                          time.perf_counter() - started, cpu_seconds(child.pid) - cpu))
        finally:
            child.terminate()
            await child.wait()
            await simulator.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The older spelling stays accepted for the scripts and notes that use it.
    parser.add_argument("--all-capabilities", "--all-hooks", action="store_true")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    parser.add_argument("--serve", nargs=2, metavar=("SOCKET", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_plugin(args.serve[0], args.serve[1], args.log_level)
    payload = recorded_create_payload()
    print(f"request: recorded CreateContainer, {len(payload)} bytes of payload; "
          f"chain: {'all capabilities' if args.all_capabilities else 'empty'}; "
          f"plugin log level: {args.log_level}")
    measure_minimal(payload, args.calls, args.all_capabilities, args.log_level)
    asyncio.run(measure_simulator(payload, args.calls, args.all_capabilities, args.log_level))


if __name__ == "__main__":
    main()
