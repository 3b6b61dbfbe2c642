"""Load on the NRI path of a running agent: throughput, latency and memory (prints numbers; not a
test).

``nri-qos run`` runs as a child process, as beside containerd, with every capability and the
whole background half (reconciler loops, detection, the ladder, the eviction manager in dry-run,
the status socket) on a fake host tree in a temporary directory; the Kubernetes API is off. This
process plays the runtime:

1. **create**: N containers (default 1,000; one pod each, their cgroups on the fake tree, every
   other pod reclaimed, every fourth with a resctrl group of its own) through the runtime
   simulator, ``--in-flight`` (32) creations at a time, each RunPodSandbox, CreateContainer and
   StartContainer.
2. **synchronize**: the runtime restarts and lists M containers (default 5,000, four per pod) in
   Synchronize chunks of ``--sync-chunk`` containers (500, with their pods), the way containerd
   splits a large Synchronize.
3. **soak**: the runtime restarts with nothing to list, then sends E events (default 100,000):
   whole pod lifecycles (RunPodSandbox, CreateContainer, StartContainer, StopContainer,
   RemoveContainer, StopPodSandbox, RemovePodSandbox), ``--in-flight`` at a time. The agent's
   resident set is sampled before, every tenth of the way and after; the status socket tells
   how many pods and containers the agent still holds.

For each phase: throughput, per-request latency percentiles (the simulator's round trip over the
unix socket, its own Python work included), the agent's CPU time per request and its resident
set (VmRSS; VmHWM for the peak). The last line is ``load create=<n>/s p99=<ms> ms;
sync=<n> containers/s; soak rss growth=<MB> MB held pods=<n>``.

    python bench/load.py [--containers 1000] [--in-flight 32] [--sync-containers 5000]
                         [--sync-chunk 500] [--events 100000] [--log-level info]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hooks.events import Event  # noqa: E402
from nri_plugin.cli.status import NoAgent, fetch  # noqa: E402
from nri_plugin.sim.simulator import PluginConnection, RuntimeSimulator  # noqa: E402
from protos import nri_api_pb2 as api  # noqa: E402
from tests.support.fakesys import GIB, FakeHost, FakePod, nri_messages  # noqa: E402
from tests.support.processes import cpu_seconds  # noqa: E402
from tests.support.raw_runtime import RawRuntime, configure_request, reset_peak, status_kib  # noqa: E402

LEVEL = "qos.nri-qos.io/level"
POD_GROUP = {"node.koordinator.sh/resctrl":
             '{"LLC":{"schemata":{"range":[20,80]}},"MB":{"schemata":{"percent":20}}}'}
LIFECYCLE = (Event.RUN_POD_SANDBOX, Event.CREATE_CONTAINER, Event.START_CONTAINER,
             Event.STOP_CONTAINER, Event.REMOVE_CONTAINER, Event.STOP_POD_SANDBOX,
             Event.REMOVE_POD_SANDBOX)
POD_EVENTS = frozenset({Event.RUN_POD_SANDBOX, Event.STOP_POD_SANDBOX, Event.REMOVE_POD_SANDBOX})
SETTLE_S = 2.0
"""Pause before a memory sample, so that the loops' cycles have run on the state as it is."""


def config(root: Path, tmp: Path) -> str:
    return f"""
[reconciler]
root = "{root}"
[eviction]
plugin_dir = "{tmp / 'eviction-plugins'}"
[kubernetes]
enabled = false
[metrics]
enabled = false
[status]
socket = "{tmp / 'status.sock'}"
[plugin]
reconnect_initial_ms = 20
reconnect_max_ms = 200
"""



def mb(kib: int) -> str:
    return f"{kib / 1024:.1f} MB"


def percentile(ordered: list[float], share: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def latency_line(name: str, seconds: list[float]) -> str:
    ordered = sorted(seconds)
    return (f"  {name:<30} n={len(ordered):<7} p50 {statistics.median(ordered) * 1e3:7.2f} ms   "
            f"p99 {percentile(ordered, 0.99) * 1e3:7.2f} ms   max {ordered[-1] * 1e3:8.2f} ms")


@dataclass
class Agent:
    pid: int
    status_socket: Path
    cpu_mark: float = 0.0
    rss_samples: list[tuple[str, int]] = field(default_factory=list)

    def rss(self) -> int:
        return status_kib(self.pid, "VmRSS")

    def peak(self) -> int:
        return status_kib(self.pid, "VmHWM")

    def cpu_since_mark(self) -> float:
        now = cpu_seconds(self.pid)
        spent, self.cpu_mark = now - self.cpu_mark, now
        return spent

    async def held(self) -> tuple[int, int]:
        """(pods, containers) the agent holds, from its status socket."""
        try:
            document = await asyncio.to_thread(fetch, str(self.status_socket))
        except NoAgent as exc:
            raise SystemExit(f"status socket: {exc}") from exc
        node: dict[str, Any] = document["node"]
        return int(node["pods"]), int(node["containers"])


def host_pod(host: FakeHost, n: int) -> FakePod:
    annotations = {LEVEL: "reclaimed_cores" if n % 2 else "shared_cores"}
    if n % 4 == 0:
        annotations.update(POD_GROUP)
    return host.add_pod(f"{n:08x}-0000-4000-8000-{n:012x}", name=f"load-{n}",
                        tier="besteffort" if n % 2 else "burstable", annotations=annotations,
                        memory_limit=GIB)



def single(pod: FakePod) -> tuple[api.PodSandbox, api.Container]:
    sandbox, (container,) = nri_messages(pod, state=api.CONTAINER_CREATED, memory_limit=GIB)
    return sandbox, container


def plain_pod(uid: str) -> tuple[api.PodSandbox, api.Container]:
    pod = api.PodSandbox(id=f"sb-{uid}", uid=uid, name=f"soak-{uid[:8]}", namespace="load",
                         annotations={LEVEL: "reclaimed_cores"})
    pod.linux.cgroup_parent = f"/kubepods/besteffort/pod{uid}"
    ctr = api.Container(id=f"c-{uid}", pod_sandbox_id=pod.id, name="app",
                        state=api.CONTAINER_CREATED)
    ctr.linux.cgroups_path = f"/kubepods/besteffort/pod{uid}/c-{uid}"
    ctr.linux.resources.memory.limit.value = GIB
    return pod, ctr


async def timed(into: list[float], call: Awaitable[object]) -> None:
    started = time.perf_counter()
    await call
    into.append(time.perf_counter() - started)


async def in_parallel(workers: int, work: Callable[[], Awaitable[None]]) -> float:
    """Run ``work`` in ``workers`` tasks; the wall time."""
    started = time.perf_counter()
    await asyncio.gather(*(work() for _ in range(workers)))
    return time.perf_counter() - started


# -- phases ---------------------------------------------------------------------------------------


async def create(agent: Agent, simulator: RuntimeSimulator, conn: PluginConnection,
                 pods: list[FakePod], in_flight: int) -> tuple[float, float]:
    views = iter([single(p) for p in pods])
    per_container: list[float] = []
    per_create: list[float] = []
    per_event: list[float] = []

    async def worker() -> None:
        for pod, ctr in views:
            started = time.perf_counter()
            await timed(per_event, simulator.send(conn, Event.RUN_POD_SANDBOX, pod))
            await timed(per_create, simulator.send(conn, Event.CREATE_CONTAINER, pod, ctr))
            ctr.state = api.CONTAINER_RUNNING
            await timed(per_event, simulator.send(conn, Event.START_CONTAINER, pod, ctr))
            per_container.append(time.perf_counter() - started)

    agent.cpu_since_mark()
    wall = await in_parallel(in_flight, worker)
    cpu = agent.cpu_since_mark()
    conn.answers.clear()
    rate = len(per_container) / wall
    print(f"create: {len(per_container)} containers, {in_flight} in flight: {rate:.0f} "
          f"containers/s ({3 * rate:.0f} requests/s), agent CPU "
          f"{cpu / (3 * len(per_container)) * 1e6:.0f} us/request")
    print(latency_line("CreateContainer", per_create))
    print(latency_line("RunPodSandbox, StartContainer", per_event))
    print(latency_line("whole container (3 calls)", per_container))
    await asyncio.sleep(SETTLE_S)
    held = await agent.held()
    print(f"  agent holds {held[0]} pods, {held[1]} containers; RSS {mb(agent.rss())}, "
          f"peak {mb(agent.peak())}")
    return rate, percentile(sorted(per_create), 0.99)


def sync_chunks(containers: int, per_pod: int, chunk: int) -> list[bytes]:
    pods = containers // per_pod
    chunks = []
    per_chunk_pods = max(1, chunk // per_pod)
    for first in range(0, pods, per_chunk_pods):
        request = api.SynchronizeRequest()
        for n in range(first, min(pods, first + per_chunk_pods)):
            uid = f"{n:08x}-1111-4000-8000-{n:012x}"
            pod = request.pods.add(id=f"sb-{uid}", uid=uid, name=f"sync-{n}", namespace="load")
            pod.annotations[LEVEL] = "shared_cores" if n % 2 else "reclaimed_cores"
            pod.linux.cgroup_parent = f"/kubepods/burstable/pod{uid}"
            for c in range(per_pod):
                ctr = request.containers.add(id=f"{uid}-{c}", pod_sandbox_id=pod.id,
                                             name=f"c{c}", state=api.CONTAINER_RUNNING)
                ctr.linux.cgroups_path = f"/kubepods/burstable/pod{uid}/{uid}-{c}"
                ctr.linux.resources.memory.limit.value = GIB
        chunks.append(request)
    for i, request in enumerate(chunks):
        request.more = i < len(chunks) - 1
    return [r.SerializeToString() for r in chunks]


async def synchronize(agent: Agent, socket_path: Path, containers: int, chunk: int) -> float:
    payloads = sync_chunks(containers, 4, chunk)
    accepted: asyncio.Queue[RawRuntime] = asyncio.Queue()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put(RawRuntime(reader, writer))

    server = await asyncio.start_unix_server(accept, path=str(socket_path), limit=16 << 20)
    try:
        async with asyncio.timeout(30):
            runtime = await accepted.get()
        await runtime.register()
        reply = await runtime.call("Configure", configure_request(request_timeout_ms=30_000))
        if not reply.ok:
            raise SystemExit(f"Configure refused: {reply.message}")
        reset_peak(agent.pid)
        agent.cpu_since_mark()
        per_chunk: list[float] = []
        started = time.perf_counter()
        for payload in payloads:
            sent = time.perf_counter()
            reply = await runtime.call("Synchronize", payload, seconds=30)
            if not reply.ok:
                raise SystemExit(f"Synchronize refused: {reply.message}")
            per_chunk.append(time.perf_counter() - sent)
        wall = time.perf_counter() - started
        cpu = agent.cpu_since_mark()
        rate = containers / wall
        size = sum(map(len, payloads))
        print(f"synchronize: {containers} containers of {containers // 4} pods in "
              f"{len(payloads)} chunks ({size / (1 << 20):.1f} MiB): {wall * 1e3:.0f} ms, "
              f"{rate:.0f} containers/s, agent CPU {cpu * 1e3:.0f} ms")
        print(latency_line("Synchronize chunk", per_chunk))
        print(f"  agent peak during it {mb(agent.peak())}")
        await asyncio.sleep(SETTLE_S)
        held = await agent.held()
        print(f"  agent holds {held[0]} pods, {held[1]} containers; RSS {mb(agent.rss())}")
        assert await runtime.create_container_ok()
        runtime.close()
    finally:
        server.close()
        await server.wait_closed()
    return rate


async def soak(agent: Agent, simulator: RuntimeSimulator, conn: PluginConnection, events: int,
               in_flight: int) -> tuple[float, int, int]:
    lifecycles = iter(range(events // len(LIFECYCLE)))
    per_event: list[float] = []
    sent = 0
    samples: list[tuple[int, int]] = []
    step = max(1, events // 10)
    await asyncio.sleep(SETTLE_S)
    before = agent.rss()
    reset_peak(agent.pid)

    async def worker() -> None:
        nonlocal sent
        for n in lifecycles:
            pod, ctr = plain_pod(f"{n:08x}-2222-4000-8000-{n:012x}")
            for event in LIFECYCLE:
                if event is Event.START_CONTAINER:
                    ctr.state = api.CONTAINER_RUNNING
                elif event is Event.STOP_CONTAINER:
                    ctr.state = api.CONTAINER_STOPPED
                await timed(per_event, simulator.send(
                    conn, event, pod, None if event in POD_EVENTS else ctr))
                sent += 1
                if sent % step == 0:
                    samples.append((sent, agent.rss()))
                    conn.answers.clear()

    agent.cpu_since_mark()
    wall = await in_parallel(in_flight, worker)
    cpu = agent.cpu_since_mark()
    rate = sent / wall
    print(f"soak: {sent} events ({sent // len(LIFECYCLE)} pod lifecycles), {in_flight} in "
          f"flight: {rate:.0f} events/s, agent CPU {cpu / sent * 1e6:.0f} us/event")
    print(latency_line("event", per_event))
    print("  RSS while it ran (after N events): "
          + ", ".join(f"{n}: {mb(kib)}" for n, kib in samples))
    await asyncio.sleep(SETTLE_S)
    after = agent.rss()
    held = await agent.held()
    print(f"  RSS before {mb(before)}, after {mb(after)} (growth {mb(after - before)}), peak "
          f"{mb(agent.peak())}; agent holds {held[0]} pods, {held[1]} containers")
    return rate, after - before, held[0] + held[1]


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="nri-load-") as tmp_name:
        tmp = Path(tmp_name)
        host = FakeHost(tmp / "host")
        host.make_resctrl()
        host.set_numa([(24 * GIB, 32 * GIB, 1000)])
        config_path = tmp / "config.toml"
        config_path.write_text(config(host.root, tmp))
        socket_path = tmp / "nri.sock"
        pods = [host_pod(host, n) for n in range(args.containers)]
        simulator = RuntimeSimulator(socket_path)
        await simulator.start()
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "nri_plugin", "run", "--config", str(config_path),
            "--socket", str(socket_path), "--log-level", args.log_level,
            cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        agent = Agent(child.pid, tmp / "status.sock")
        try:
            conn = await simulator.wait_ready(timeout_s=30)
            await asyncio.sleep(SETTLE_S)
            print(f"agent started: RSS {mb(agent.rss())}; log level {args.log_level}")
            create_rate, create_p99 = await create(agent, simulator, conn, pods,
                                                   args.in_flight)
            await simulator.stop()
            sync_rate = await synchronize(agent, socket_path, args.sync_containers,
                                          args.sync_chunk)
            simulator = RuntimeSimulator(socket_path)
            await simulator.start()
            conn = await simulator.wait_ready(timeout_s=30)
            soak_rate, growth, held = await soak(agent, simulator, conn, args.events,
                                                 args.in_flight)
        finally:
            if child.returncode is None:
                child.terminate()
            await child.wait()
            await simulator.stop()
    print(f"load create={create_rate:.0f}/s p99={create_p99 * 1e3:.2f} ms; "
          f"sync={sync_rate:.0f} containers/s; soak {soak_rate:.0f} events/s rss "
          f"growth={growth / 1024:.1f} MB held pods+containers={held}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--sync-containers", type=int, default=5000)
    parser.add_argument("--sync-chunk", type=int, default=500)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
