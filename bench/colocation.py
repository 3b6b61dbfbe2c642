"""Colocation: does nri-qos keep an online workload's latency beside a memory-hungry offline job?

On this machine's real kernel, a private node (:mod:`bench.kubelet_node`: a child cgroup of the
memory hierarchy with a limit, laid out as kubelet lays out its cgroups) runs two pods:

* **online**, a Burstable pod (memory request 512 MiB, limit 1 GiB, CPU request 1): fixed work
  per iteration touching its own anonymous memory and reading a file set through the page cache
  (:mod:`bench.colocation_workloads`); every iteration's latency is recorded;
* **offline**, a BestEffort pod (no limit), started once the online one is warm: it grows
  anonymous memory and streams a file larger than the node through the page cache, writing
  an output as it goes; its progress (bytes read and written) is recorded over time.

Each repetition runs the scenario on a fresh node in one of the modes of
:mod:`bench.baselines`: ``unmanaged`` (kubelet's defaults), ``static`` (kubelet's QOSReserved
tier limits), ``kubelet-memoryqos`` (kubelet's MemoryQoS, cgroup v2), ``agent-creation`` (the
real agent, detection and ladder off) and ``agent`` (the real agent, every default, enforcing).
The agent is a real ``nri-qos run`` child process, configured only where the host is
(``reconciler.root``: the node), where the API server is (a fake one on loopback: the taint is
a real API write) and where the audit trail goes; the pods reach it as a runtime would bring
them: RunPodSandbox, CreateContainer (its answer applied to the container as the runtime would)
and StartContainer over the NRI protocol from the runtime simulator. Eviction stays in dry-run,
as by default.

Method: a warm-up block of every mode (not counted), then ``--reps`` blocks of every mode once,
each block in an order drawn from ``--seed`` (printed); before each repetition the caches are
dropped and the machine left idle (``--idle-s``); each repetition writes its output into a
fresh directory. The window is the offline job's run: from its start for ``--duration``
seconds. Printed: one table (online iteration latency p50/p99/p99.9 over the window; the
kernel's reclaim indicators for the online container: major faults, refaults of evicted file
pages, its stall on memory, io and cpu from PSI; how often ``kubepods`` hit its limit; offline
progress in MiB; what the agent did, from its audit records), each mode's bootstrap 95 %
intervals of the per-repetition p99 (median) and of the offline MiB (mean), and last the line
``online p99 ms: unmanaged=… static=… kubelet-memoryqos=… agent-creation=… agent=…; offline MiB:
unmanaged=… …`` (pooled p99; mean MiB per repetition; modes not run left out). ``--plot`` draws
the latency CDFs and the offline progress over time (matplotlib, the ``bench`` extra).

    python bench/colocation.py [--duration 90] [--reps 3] [--quick] [--modes M,M] [--seed N]
                               [--idle-s 5] [--plot PNG] [--json PATH] [--keep DIR]
                               [--data-dir DIR] [--agent-from SOURCE_TREE]
    python bench/colocation.py --from-json PATH [--plot PNG]     # the table (and plot) again

Needs root and a memory cgroup controller, and about 1.3 GB of disk under /var/tmp for the data
(written from inside a node, so their page cache is never charged to the machine). Every
cgroup, process and file made is removed at the end, also on Ctrl-C or SIGTERM; what a run
killed outright leaves (its node's cgroups with the agent in them, its directory) is removed
by the next run. ``docs/effectiveness.md`` has a documented run.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import bisect
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines import (
    AGENT_MODES,
    MODES,
    block_order,
    bootstrap_interval,
    memory_high,
    modes_for,
    static_limits,
)
from bench.kubelet_node import (
    GIB,
    MIB,
    Container,
    KubeletNode,
    kubelet_oom_score_adj,
    sweep,
    unavailable,
    v2_memory,
)
from hooks.events import Event
from nri_plugin.sim.scenario import ContainerSpec, PodSpec
from nri_plugin.sim.simulator import (
    PluginConnection,
    RuntimeSimulator,
    container_message,
    pod_message,
)
from protos import nri_api_pb2 as api
from tests.support.fake_apiserver import FakeApiServer, make_pod, write_kubeconfig

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = Path(__file__).with_name("colocation_workloads.py")
NODE_NAME = "colocation-node"
CPUS = os.cpu_count() or 1
SETTLE_S = 3.0
"""The online pod alone before the offline one starts: its warm baseline."""
READY_TIMEOUT_S = 120.0
"""For the agent to be synchronized, and for the online pod to have read its files."""


@dataclasses.dataclass(frozen=True)
class PodPlan:
    name: str
    namespace: str
    uid: str
    container_id: str
    tier: str
    memory_request: int | None
    memory_limit: int | None
    cpu_request_milli: int


ONLINE = PodPlan("web-0", "shop", "0c010c01-0000-4000-8000-000000000001", "a1" * 32,
                 "burstable", 512 * MIB, 1 * GIB, 1000)
OFFLINE = PodPlan("etl-0", "batch", "0c010c01-0000-4000-8000-000000000002", "b2" * 32,
                  "besteffort", None, None, 0)


@dataclasses.dataclass
class Settings:
    duration_s: float
    reps: int
    node_mib: int
    reserved_mib: int
    online_files_mib: int
    online_anon_mib: int
    offline_anon_mib: int
    offline_grow_mib_s: float
    offline_task_s: float
    offline_input_mib: int
    offline_write_every: int
    modes: tuple[str, ...]
    # The source tree the agent runs from ("" for this one).
    agent_source: str = ""
    # Of the blocks' order (printed, so that a run can be repeated).
    seed: int = 0
    # Before each repetition: caches dropped, then this long idle.
    idle_s: float = 5.0


# -- one repetition -------------------------------------------------------------------------------


@dataclasses.dataclass
class Repetition:
    mode: str
    index: int
    latencies_ms: list[float]  # iterations that started inside the window
    alone_ms: list[float]  # iterations before the offline pod started
    progress: list[tuple[float, float]]  # (seconds into the window, MB processed)
    indicators: dict[str, float | None]
    actions: dict[str, int]
    events: list[tuple[float, str]]  # (seconds into the window, what the agent did)
    adjustments: list[str]
    problems: list[str]

    @property
    def offline_mb(self) -> float:
        return self.progress[-1][1] if self.progress else 0.0


class Agent:
    """A real ``nri-qos run`` process (in the node's system cgroup, a node daemon) beside the
    runtime simulator and a fake API server; an async context manager: entered, the agent is
    synchronized and settled; left, all is gone."""

    def __init__(self, node: KubeletNode, work: Path, source: Path, *,
                 creation_only: bool = False) -> None:
        self.node = node
        self.creation_only = creation_only
        self.source = source
        self.work = work
        self.audit_file = work / "audit.jsonl"
        self.log_file = work / "agent.log"
        self.socket = work / "nri.sock"
        self.simulator = RuntimeSimulator(self.socket)
        self.connection: PluginConnection | None = None
        self._stack = contextlib.AsyncExitStack()

    def config(self, root: Path, kubeconfig: Path) -> str:
        return (
            "# Everything not set here keeps its default (deploy/config.toml); the agent acts\n"
            "# (enforce), where a first install only observes.\n"
            '[agent]\nmode = "enforce"\n'
            f'[reconciler]\nroot = "{root}"\n'
            f'[kubernetes]\nkubeconfig = "{kubeconfig}"\nnode_name = "{NODE_NAME}"\n'
            f'[logging]\naudit_file = "{self.audit_file}"\n'
            f'[status]\nsocket = "{self.work / "status.sock"}"\n'
            # agent-creation: the answers, the guard and drift repair; no detection, no ladder
            + ('[detection]\nenabled = false\n[mitigation]\nenabled = false\n'
               if self.creation_only else "")
        )

    async def __aenter__(self) -> Agent:
        async with contextlib.AsyncExitStack() as stack:
            server = stack.enter_context(FakeApiServer())
            server.add_node(NODE_NAME)
            for plan in (ONLINE, OFFLINE):
                memory = {"main": (_quantity(plan.memory_request), _quantity(plan.memory_limit))}
                server.add_pod(make_pod(plan.name, namespace=plan.namespace, node=NODE_NAME,
                                        uid=plan.uid, memory=memory))
            kubeconfig = write_kubeconfig(self.work / "kubeconfig", server.url)
            config = self.work / "config.toml"
            config.write_text(self.config(self.node.agent_root(self.work), kubeconfig))
            await self.simulator.start()
            stack.push_async_callback(self.simulator.stop)
            log = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            stack.callback(os.close, log)
            # A node daemon: in the node's system cgroup, so that a run killed outright does
            # not leave it behind (the next run's sweep ends what is left in the node).
            process = await asyncio.create_subprocess_exec(
                *self.node.inside(self.node.add_system("nri-qos"), [
                    sys.executable, "-m", "nri_plugin", "run", "--config", str(config),
                    "--socket", str(self.socket)], None),
                cwd=self.source, stdout=log, stderr=log)
            stack.push_async_callback(_terminate, process)
            self.connection = await self.simulator.wait_ready(timeout_s=READY_TIMEOUT_S)
            # Settled: the ladder's release of every rung at start (four records), detection's
            # first cycle (the memcg event registrations) after that; without the ladder, the
            # first memory guard cycle.
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not self._settled():
                if time.monotonic() > deadline or process.returncode is not None:
                    raise RuntimeError(f"the agent did not settle; see {self.log_file}")
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.5)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def _settled(self) -> bool:
        events = [event for _, event, _ in self.records()]
        if self.creation_only:
            return "memory_guard_cap" in events
        return events.count("mitigation_action") >= 4

    async def create(self, plan: PodPlan, container: Container) -> api.ContainerAdjustment:
        """RunPodSandbox and CreateContainer for a pod; the adjustment to apply."""
        assert self.connection is not None
        pod, message = _messages(plan, container, api.CONTAINER_CREATED)
        await self.simulator.send(self.connection, Event.RUN_POD_SANDBOX, pod)
        answer = await self.simulator.send(self.connection, Event.CREATE_CONTAINER, pod, message)
        if isinstance(answer, api.CreateContainerResponse):
            return answer.adjust
        return api.ContainerAdjustment()

    async def started(self, plan: PodPlan, container: Container, pid: int) -> None:
        assert self.connection is not None
        pod, message = _messages(plan, container, api.CONTAINER_RUNNING)
        message.pid = pid
        await self.simulator.send(self.connection, Event.START_CONTAINER, pod, message)

    def records(self) -> list[tuple[float, str, dict[str, Any]]]:
        """The audit trail so far: (unix time, event, fields)."""
        if not self.audit_file.exists():
            return []
        found = []
        for line in self.audit_file.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                stamp = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00"))
                found.append((stamp.timestamp(), record["event"], record))
        return found


async def _terminate(process: asyncio.subprocess.Process) -> None:
    """Stop the agent as a service manager would: SIGTERM, then SIGKILL after 15 s."""
    if process.returncode is not None:
        return
    process.terminate()
    try:
        await asyncio.wait_for(process.wait(), 15)
    except TimeoutError:
        process.kill()
        await process.wait()


def _quantity(value: int | None) -> str | None:
    return None if value is None else f"{value // MIB}Mi"


def _messages(plan: PodPlan, container: Container,
              state: int) -> tuple[api.PodSandbox, api.Container]:
    spec = PodSpec(id=f"sandbox-{plan.name}", uid=plan.uid, name=plan.name,
                   namespace=plan.namespace, cgroup_parent=f"/{container.pod_rel}")
    ctr = ContainerSpec(id=plan.container_id, pod=spec.id, name="main",
                        memory_limit=plan.memory_limit or 0)
    return pod_message(spec), container_message(ctr, spec, state)


def apply_adjustment(node: KubeletNode, container: Container, adjust: api.ContainerAdjustment,
                     oom_score_adj: int) -> tuple[int, list[str]]:
    """What the runtime does with a CreateContainer answer: the oom_score_adj to start the
    container with and the memory settings of its cgroup; also what was applied, as text."""
    applied: list[str] = []
    linux = adjust.linux
    if linux.HasField("oom_score_adj"):
        oom_score_adj = linux.oom_score_adj.value
        applied.append(f"oom_score_adj={oom_score_adj}")
    memory = linux.resources.memory
    if memory.HasField("limit"):
        node.set_limit(container.rel, memory.limit.value)
        applied.append(f"memory limit={memory.limit.value}")
    if memory.HasField("reservation"):
        name = "memory.low" if node.v2 else "memory.soft_limit_in_bytes"
        (node.memory / container.rel / name).write_text(str(memory.reservation.value))
        applied.append(f"{name}={memory.reservation.value}")
    for key, value in linux.resources.unified.items():
        if node.v2:
            (node.memory / container.rel / key).write_text(value)
            applied.append(f"{key}={value}")
        else:
            applied.append(f"{key}={value} (not applied: cgroup v1)")
    return oom_score_adj, applied


def system_stall_us(resource: str) -> int | None:
    """The machine's cumulative 'some' stall (µs), from /proc/pressure."""
    try:
        text = Path(f"/proc/pressure/{resource}").read_text()
    except OSError:
        return None
    return int(text.splitlines()[0].rsplit("total=", 1)[1])


def snapshot(node: KubeletNode, online: Container,
             offline: Container) -> dict[str, int | None]:
    """The kernel's counters that tell whether the online container was reclaimed from."""
    stat = node.stat(online.rel)
    prefix = "" if node.v2 else "total_"
    return {
        "majfault": stat.get(f"{prefix}pgmajfault"),
        "refault": stat.get(f"{prefix}workingset_refault_file"),
        "pgscan": stat.get("pgscan") if node.v2 else None,  # v1 memory.stat has none
        "kubepods_hits": node.limit_hits("kubepods"),
        "offline_tier_hits": node.limit_hits("kubepods/besteffort"),
        "psi_memory_us": node.stall_us(online.rel, "memory"),
        "psi_io_us": node.stall_us(online.rel, "io"),
        "psi_cpu_us": node.stall_us(online.rel, "cpu"),
        "offline_psi_memory_us": node.stall_us(offline.rel, "memory"),
        "system_psi_memory_us": system_stall_us("memory"),
    }


def indicator_deltas(before: dict[str, int | None], after: dict[str, int | None],
                     seconds: float) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, start in before.items():
        end = after[key]
        delta = None if start is None or end is None else end - start
        if key.endswith("_us"):  # a stall share: ms of stall per second
            out[key.replace("_us", "_ms_s")] = None if delta is None else delta / 1000 / seconds
        else:
            out[key] = delta
    return out


def read_latencies(path: Path) -> list[tuple[int, int]]:
    """The online workload's (start, duration) pairs, in ns."""
    values = array.array("q")
    if path.exists():
        data = path.read_bytes()
        values.frombytes(data[: len(data) // 16 * 16])
    return list(zip(values[0::2], values[1::2], strict=True))


def read_progress(path: Path, t0_ns: int, t1_ns: int) -> list[tuple[float, float]]:
    points: list[tuple[float, float]] = [(0.0, 0.0)]
    if not path.exists():
        return points
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) != 4:
            continue
        at, read, written = int(fields[0]), int(fields[1]), int(fields[2])
        if at <= t1_ns:
            points.append(((at - t0_ns) / 1e9, (read + written) / MIB))
    return points


def summarize_actions(records: Sequence[tuple[float, str, dict[str, Any]]], start: float,
                      end: float) -> dict[str, int]:
    """What the agent did in the window, from its audit trail."""
    counts: Counter[str] = Counter()
    for at, event, fields in records:
        if not start <= at <= end:
            continue
        if event == "mitigation_action":
            counts[f"{fields['action']} {fields['step']} {fields['result']}"] += 1
        elif event == "memory_guard_cap" and fields.get("squeezed"):
            counts["squeeze limit writes"] += 1
        elif event == "mitigation_level":
            counts[f"ladder level {fields['ladder_level']}"] += 1
        elif event in ("drop_cache_finished", "eviction_dry_run", "eviction_chosen",
                       "taint_added", "taint_removed"):
            counts[event] += 1
    return dict(counts)


def timeline(records: Sequence[tuple[float, str, dict[str, Any]]], start: float,
             end: float) -> list[tuple[float, str]]:
    """When in the window the agent acted (seconds from its start), for the record and the
    plot."""
    found = []
    for at, event, fields in records:
        if not start <= at <= end:
            continue
        if event == "mitigation_action" and fields["result"] not in ("unchanged", "skipped"):
            found.append((at - start, f"{fields['action']} {fields['step']}"))
        elif event == "memory_guard_cap" and fields.get("squeezed"):
            found.append((at - start, f"squeeze to {fields['cap_bytes'] >> 20} MiB"))
        elif event == "mitigation_level":
            found.append((at - start, f"level {fields['ladder_level']}"))
        elif event == "drop_cache_finished":
            found.append((at - start, f"drop cache freed {fields['freed_bytes'] >> 20} MiB"))
    return found


def memory_qos(node: KubeletNode, plan: PodPlan, container: Container) -> list[str]:
    """What kubelet's MemoryQoS writes for a container (cgroup v2): memory.min = the request on
    the container, its pod and its tier (the tier's is the sum; one pod of each here), and
    memory.high on the container unless request = limit (Guaranteed)."""
    request = plan.memory_request or 0
    applied = []
    if request:
        for rel in (container.rel, container.pod_rel, f"kubepods/{plan.tier}"):
            (node.memory / rel / "memory.min").write_text(str(request))
        applied.append(f"memory.min={request}")
    if plan.memory_limit is None or request != plan.memory_limit:
        high = memory_high(request, plan.memory_limit, node.allocatable_bytes)
        (node.memory / container.rel / "memory.high").write_text(str(high))
        applied.append(f"memory.high={high}")
    return applied


async def read_line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    return await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), READY_TIMEOUT_S)


async def repetition(mode: str, index: int, settings: Settings, data: Path,
                     work: Path) -> Repetition:
    problems: list[str] = []
    adjustments: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        node = KubeletNode("coloc", settings.node_mib * MIB, settings.reserved_mib * MIB, CPUS)
        stack.callback(node.close)
        online = node.add_pod(ONLINE.tier, ONLINE.uid, ONLINE.container_id,
                              memory_limit=ONLINE.memory_limit,
                              cpu_request_milli=ONLINE.cpu_request_milli)
        offline = node.add_pod(OFFLINE.tier, OFFLINE.uid, OFFLINE.container_id,
                               memory_limit=OFFLINE.memory_limit,
                               cpu_request_milli=OFFLINE.cpu_request_milli)
        agent = None
        if mode in AGENT_MODES:
            agent = await stack.enter_async_context(
                Agent(node, work, Path(settings.agent_source or REPO),
                      creation_only=mode == "agent-creation"))
        elif mode == "static":
            burstable = sum(p.memory_request or 0 for p in (ONLINE, OFFLINE)
                            if p.tier == "burstable")
            for rel, limit in static_limits(node.allocatable_bytes, burstable, 0).items():
                node.set_limit(rel, limit)
        online_out, offline_out = work / "online.bin", work / "offline.txt"

        async def start(plan: PodPlan, container: Container,
                        argv: list[str]) -> subprocess.Popen[str]:
            adjust = api.ContainerAdjustment()
            if agent is not None:
                adjust = await agent.create(plan, container)
            oom = kubelet_oom_score_adj(plan.memory_request or 0, node.memory_bytes,
                                        plan.tier)
            oom, applied = apply_adjustment(node, container, adjust, oom)
            if mode == "kubelet-memoryqos":
                applied = memory_qos(node, plan, container)
            adjustments.extend(f"{plan.name}: {a}" for a in applied)
            process = node.spawn(container.rel, [sys.executable, "-I", str(WORKLOADS), *argv],
                                 oom_score_adj=oom)
            if agent is not None:
                await agent.started(plan, container, process.pid)
            return process

        online_process = await start(ONLINE, online, [
            "online", "--files", str(data / "online"), "--anon-mib",
            str(settings.online_anon_mib), "--out", str(online_out)])
        if (await read_line(online_process)).strip() != "ready":
            raise RuntimeError("the online workload did not start")
        await asyncio.sleep(SETTLE_S)
        before = snapshot(node, online, offline)
        t0_ns, t0_unix = time.monotonic_ns(), time.time()
        offline_process = await start(OFFLINE, offline, [
            "offline", "--input", str(data / "input.bin"), "--output",
            str(work / "output.bin"), "--anon-mib", str(settings.offline_anon_mib),
            "--grow-mib-s", str(settings.offline_grow_mib_s), "--task-s",
            str(settings.offline_task_s), "--write-every",
            str(settings.offline_write_every), "--out", str(offline_out)])
        deadline = time.monotonic() + settings.duration_s
        while time.monotonic() < deadline:
            await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
            for name, process in (("online", online_process), ("offline", offline_process)):
                if process.poll() is not None:
                    problems.append(f"{name} workload ended early (status {process.returncode})")
            if problems:
                break
        after = snapshot(node, online, offline)
        t1_ns, t1_unix = time.monotonic_ns(), time.time()
        await asyncio.gather(asyncio.to_thread(node.stop, offline_process),
                             asyncio.to_thread(node.stop, online_process))
        samples = read_latencies(online_out)
        records = agent.records() if agent is not None else []
        return Repetition(
            mode=mode, index=index,
            latencies_ms=[d / 1e6 for s, d in samples if t0_ns <= s < t1_ns],
            alone_ms=[d / 1e6 for s, d in samples if s < t0_ns],
            progress=read_progress(offline_out, t0_ns, t1_ns),
            indicators=indicator_deltas(before, after, (t1_ns - t0_ns) / 1e9),
            actions=summarize_actions(records, t0_unix, t1_unix),
            events=timeline(records, t0_unix, t1_unix),
            adjustments=adjustments, problems=problems)


# -- data -----------------------------------------------------------------------------------------


def prepare_data(data: Path, settings: Settings) -> None:
    """The online file set and the offline input, written from inside a node (its page cache
    charged there, never to the machine) and dropped from the cache; kept when already there."""
    wanted = {data / "input.bin": settings.offline_input_mib}
    files = 8
    for i in range(files):
        wanted[data / "online" / f"part{i}.bin"] = max(settings.online_files_mib // files, 1)
    missing = {p: m for p, m in wanted.items()
               if not p.exists() or p.stat().st_size != m * MIB}
    if not missing:
        return
    (data / "online").mkdir(parents=True, exist_ok=True)
    node = KubeletNode("colocdata", min(settings.node_mib, 1024) * MIB, 0, CPUS)
    try:
        writer = node.add_pod("besteffort", "0c010c01-0000-4000-8000-0000000000da", "writer",
                              memory_limit=None, cpu_request_milli=0)
        for path, mib in missing.items():
            print(f"writing {path} ({mib} MiB)", flush=True)
            process = node.spawn(writer.rel, [sys.executable, "-I", str(WORKLOADS), "write",
                                              "--path", str(path), "--mib", str(mib)],
                                 oom_score_adj=1000)
            process.communicate()
            if process.returncode:
                raise RuntimeError(f"writing {path} failed (status {process.returncode})")
    finally:
        node.close()


# -- results --------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of sorted ``values``, linearly interpolated."""
    if not values:
        return math.nan
    position = q * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


COLUMNS = ("mode", "rep", "iters", "alone p99", "p50", "p99", "p99.9", "max", "majflt",
           "refaults", "kubepods hits", "PSI mem", "PSI io", "PSI cpu",
           "offline MiB", "MiB/s", "agent actions")


def table_rows(reps: Sequence[Repetition], duration_s: float) -> list[list[str]]:
    rows = []
    for mode in dict.fromkeys(r.mode for r in reps):
        mine = [r for r in reps if r.mode == mode]
        for r in [*mine, None]:
            group = mine if r is None else [r]
            lat = sorted(v for g in group for v in g.latencies_ms)
            alone = sorted(v for g in group for v in g.alone_ms)
            ind = {k: mean([g.indicators.get(k) for g in group]) for k in group[0].indicators}
            mb = mean([g.offline_mb for g in group]) or 0.0
            actions: Counter[str] = Counter()
            for g in group:
                actions.update(g.actions)
            rows.append([
                mode, "all" if r is None else str(r.index), str(len(lat)),
                fmt(percentile(alone, 0.99), 2), fmt(percentile(lat, 0.5), 2),
                fmt(percentile(lat, 0.99), 2), fmt(percentile(lat, 0.999), 2),
                fmt(lat[-1] if lat else None, 1), fmt(ind.get("majfault"), 0),
                fmt(ind.get("refault"), 0), fmt(ind.get("kubepods_hits"), 0),
                fmt(ind.get("psi_memory_ms_s"), 1), fmt(ind.get("psi_io_ms_s"), 1),
                fmt(ind.get("psi_cpu_ms_s"), 1),
                fmt(mb, 0), fmt(mb / duration_s, 0),
                actions_text(actions, len(group)) if mode in AGENT_MODES else "-",
            ])
    return rows


def actions_text(actions: Counter[str], reps: int) -> str:
    """The agent's actions, per repetition on average when several are pooled."""
    def n(key: str) -> str:
        count = sum(v for k, v in actions.items() if k.startswith(key))
        return f"{count / reps:.1f}".removesuffix(".0")

    return (f"tune {n('tune engage')}+{n('tune release')} rel, squeeze writes "
            f"{n('squeeze limit writes')}, taint {n('taint engage')}, drop_cache "
            f"{n('drop_cache engage')}+{n('drop_cache repeat')}, evict (dry-run) "
            f"{n('evict engage')}+{n('evict repeat')}")


def print_table(reps: Sequence[Repetition], settings: Settings) -> None:
    rows = table_rows(reps, settings.duration_s)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    print("latency: online iteration (ms); indicators: online container over the window (mean "
          "per repetition), PSI as ms of 'some' stall per second; kubepods hits: charges that "
          "hit the node-allocatable limit; offline MiB: read + written in the window (mean per "
          "repetition)")
    print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                    enumerate(zip(COLUMNS, widths, strict=True))))
    for row in rows:
        print("  ".join(v.rjust(w) if 0 < i < len(row) - 1 else v.ljust(w) for i, (v, w) in
                        enumerate(zip(row, widths, strict=True))))
    for r in reps:
        for problem in r.problems:
            print(f"{r.mode} rep {r.index}: {problem}")
    applied = sorted({a for r in reps for a in r.adjustments})
    if applied:
        print(f"applied from the agent's CreateContainer answers: {'; '.join(applied)}")


def rep_p99(rep: Repetition) -> float:
    return percentile(sorted(rep.latencies_ms), 0.99)


def intervals(reps: Sequence[Repetition], seed: int) -> dict[str, dict[str, tuple[float, float]]]:
    """Per mode, the bootstrap 95 % intervals of the median per-repetition p99 and of the mean
    offline MiB, over its repetitions."""
    found = {}
    for mode in dict.fromkeys(r.mode for r in reps):
        mine = [r for r in reps if r.mode == mode]
        found[mode] = {
            "p99": bootstrap_interval([rep_p99(r) for r in mine],
                                      lambda v: percentile(sorted(v), 0.5), seed),
            "offline": bootstrap_interval([r.offline_mb for r in mine],
                                          lambda v: sum(v) / len(v), seed)}
    return found


def print_intervals(reps: Sequence[Repetition], seed: int) -> None:
    for mode, found in intervals(reps, seed).items():
        (p_lo, p_hi), (o_lo, o_hi) = found["p99"], found["offline"]
        print(f"{mode}: per-repetition p99 95 % interval {fmt(p_lo, 2)}-{fmt(p_hi, 2)} ms; "
              f"offline {fmt(o_lo, 0)}-{fmt(o_hi, 0)} MiB")


def final_line(reps: Sequence[Repetition]) -> str:
    """``online p99 ms: unmanaged=… static=… …; offline MiB: unmanaged=… …`` over the modes
    that ran, in the order of MODES (pooled p99; mean offline MiB per repetition)."""
    ran = [m for m in MODES if any(r.mode == m for r in reps)]

    def p99(mode: str) -> float:
        return percentile(sorted(v for r in reps if r.mode == mode for v in r.latencies_ms), 0.99)

    def mib(mode: str) -> float:
        return mean([r.offline_mb for r in reps if r.mode == mode]) or 0.0

    return ("online p99 ms: " + " ".join(f"{m}={fmt(p99(m), 2)}" for m in ran)
            + "; offline MiB: " + " ".join(f"{m}={mib(m):.0f}" for m in ran))


def plot(reps: Sequence[Repetition], path: Path, title: str) -> None:
    """Online latency CDFs and offline progress over time, one colour per mode."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is missing (pip install -e '.[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    colours = {"unmanaged": "tab:red", "static": "tab:orange", "kubelet-memoryqos": "tab:olive",
               "agent-creation": "tab:cyan", "agent": "tab:blue"}
    fig, (cdf, progress) = plt.subplots(1, 2, figsize=(12, 4.8))
    for mode, colour in colours.items():
        lat = sorted(v for r in reps if r.mode == mode for v in r.latencies_ms)
        if not lat:
            continue
        n = len(lat)
        # A point per distinct rank, thinned where the curve is flat (the bulk).
        ranks = sorted({*range(0, n, max(n // 2000, 1)), *range(max(n - 2000, 0), n)})
        cdf.plot([lat[i] for i in ranks], [(i + 0.5) / n for i in ranks], color=colour,
                 label=f"{mode} (p99 {percentile(lat, 0.99):.2f} ms)")
        for r in (r for r in reps if r.mode == mode):
            xs, ys = zip(*r.progress, strict=True)
            progress.plot(xs, [y / 1024 for y in ys], color=colour, alpha=0.7,
                          label=mode if r.index == min(x.index for x in reps
                                                       if x.mode == mode) else None)
            # where the agent squeezed the offline tier, on that repetition's line
            squeezes = [t for t, what in r.events if what.startswith("squeeze")]
            if squeezes:
                at = [bisect.bisect_right(xs, t) - 1 for t in squeezes]
                progress.plot(squeezes, [ys[max(i, 0)] / 1024 for i in at], "v", color=colour,
                              markersize=6, label="squeeze (limit written)"
                              if r is next(x for x in reps if x.events) else None)
    alone = sorted(v for r in reps for v in r.alone_ms)
    if alone:
        n = len(alone)
        cdf.plot(alone, [(i + 0.5) / n for i in range(n)], color="tab:gray", linestyle=":",
                 label=f"online alone (p99 {percentile(alone, 0.99):.2f} ms)")
    cdf.set_xscale("log")
    # logit: the tail (p99, p99.9) gets as much room as the body
    cdf.set_yscale("logit")
    cdf.set_ylim(0.01, 0.9999)
    ticks = [0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.9999]
    cdf.yaxis.set_major_locator(FixedLocator(ticks))
    cdf.yaxis.set_major_formatter(FixedFormatter([f"p{100 * t:g}" for t in ticks]))
    cdf.yaxis.set_minor_locator(NullLocator())
    cdf.set_xlabel("online iteration latency (ms)")
    cdf.set_ylabel("share of iterations at or below (percentile)")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(loc="lower right")
    cdf.set_title("online latency (CDF)")
    progress.set_xlabel("seconds since the offline pod started")
    progress.set_ylabel("offline data processed (GiB read + written)")
    progress.grid(True, alpha=0.3)
    progress.legend(loc="upper left")
    progress.set_title("offline progress (one line per repetition)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


# -- driving --------------------------------------------------------------------------------------


def quiet_machine(idle_s: float) -> None:
    """Between repetitions: the page cache dropped (what a run left charged to a removed node's
    cgroup stays in memory otherwise), then an idle gap."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")
    time.sleep(idle_s)


async def run(settings: Settings, data: Path, under: Path, *, keep: bool) -> list[Repetition]:
    """A warm-up block, then ``reps`` blocks of every mode once, each block in an order drawn
    from ``settings.seed`` (:func:`bench.baselines.block_order`); each repetition in a work
    directory under ``under`` (removed after it unless ``keep``), after the caches were dropped
    and the machine left idle. The warm-up block's repetitions are not returned."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for signum in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, task.cancel)
    reps: list[Repetition] = []
    print(f"order: seed {settings.seed}; block 0 is a warm-up, not counted", flush=True)
    for mode, index in block_order(settings.modes, settings.reps + 1, settings.seed):
        work = Path(tempfile.mkdtemp(prefix=f"coloc-{mode}-{index}-", dir=under))
        try:
            await asyncio.to_thread(quiet_machine, settings.idle_s)
            name = "warm-up" if index == 0 else f"repetition {index}/{settings.reps}"
            print(f"{mode} {name}: {settings.duration_s:g} s", flush=True)
            rep = await repetition(mode, index, settings, data, work)
            if index:
                reps.append(rep)
            lat = sorted(rep.latencies_ms)
            print(f"  online p50 {fmt(percentile(lat, 0.5), 2)} ms p99 "
                  f"{fmt(percentile(lat, 0.99), 2)} ms ({len(lat)} iterations); offline "
                  f"{rep.offline_mb:.0f} MiB; agent: {rep.actions or '-'}", flush=True)
        finally:
            if not keep:
                shutil.rmtree(work, ignore_errors=True)
    return reps


def as_json(reps: Sequence[Repetition], settings: Settings, machine: dict[str, str]) -> str:
    return json.dumps({"settings": dataclasses.asdict(settings), "machine": machine,
                       "repetitions": [dataclasses.asdict(r) for r in reps]})


def from_json(text: str) -> tuple[list[Repetition], Settings, dict[str, str]]:
    raw = json.loads(text)
    settings = Settings(**{**raw["settings"], "modes": tuple(raw["settings"]["modes"])})
    reps = [Repetition(**{**r, "progress": [tuple(p) for p in r["progress"]],
                          "events": [tuple(e) for e in r["events"]]})
            for r in raw["repetitions"]]
    return reps, settings, raw["machine"]


def machine_facts(version: str) -> dict[str, str]:
    meminfo = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()
    return {"kernel": os.uname().release, "cpus": str(CPUS),
            "memory": f"{int(meminfo[1]) // 1024 // 1024} GiB", "cgroup": version}


RUN_DIRS = Path("/var/tmp")
RUN_PREFIX = "nri-qos-colocation-"


@contextlib.contextmanager
def run_dir() -> Iterator[Path]:
    """This run's scratch directory (data files, work directories), removed at the end; one
    left by a run that was killed outright is removed by the next run."""
    for old in RUN_DIRS.glob(f"{RUN_PREFIX}*"):
        pid = old.name[len(RUN_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            print(f"removed a directory left by an earlier run: {old}")
            shutil.rmtree(old, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"{RUN_PREFIX}{os.getpid()}-",
                                     dir=RUN_DIRS) as tmp:
        yield Path(tmp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=90.0,
                        help="seconds of each repetition's window (the offline job's run)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each mode")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: 20 s windows, one counted block after the warm-up")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated, of " + ", ".join(MODES) + " (kubelet-memoryqos "
                             "only where the memory controller is cgroup v2); default: all")
    parser.add_argument("--seed", type=int, help="of the blocks' order (default: drawn, and "
                                                 "printed)")
    parser.add_argument("--idle-s", type=float, default=5.0,
                        help="idle time after the caches are dropped, before each repetition")
    parser.add_argument("--node-mib", type=int, default=3072)
    parser.add_argument("--reserved-mib", type=int, default=256,
                        help="the node's memory kept from kubepods (system reserved)")
    parser.add_argument("--online-files-mib", type=int, default=256)
    parser.add_argument("--online-anon-mib", type=int, default=64)
    parser.add_argument("--offline-anon-mib", type=int, default=2048)
    parser.add_argument("--offline-grow-mib-s", type=float, default=1024.0)
    parser.add_argument("--offline-task-s", type=float, default=6.0,
                        help="each task of the offline job grows its buffer, then frees it")
    parser.add_argument("--offline-input-mib", type=int, default=1024,
                        help="the offline job's data set, read over and over (its epochs)")
    parser.add_argument("--offline-write-every", type=int, default=8,
                        help="the offline job writes 1 MiB per this many MiB read")
    parser.add_argument("--agent-from", default="",
                        help="run the agent from this source tree (python -m nri_plugin there), "
                             "to compare versions; default: this one")
    parser.add_argument("--data-dir", help="where the data files are kept (reused when there); "
                                           "default: this run's directory under /var/tmp")
    parser.add_argument("--keep", help="keep each repetition's work directory (agent log, "
                                       "audit trail, raw samples) under this directory")
    parser.add_argument("--plot", help="draw the latency CDFs and offline progress into this PNG")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--from-json", help="print (and --plot) earlier raw results; no run")
    args = parser.parse_args()

    if args.from_json:
        reps, settings, machine = from_json(Path(args.from_json).read_text())
    else:
        problem = unavailable()
        if problem:
            print(f"colocation: cannot run here ({problem})")
            print("online p99 ms: -; offline MiB: -")
            return 1
        settings = Settings(
            duration_s=20.0 if args.quick else args.duration, reps=1 if args.quick else args.reps,
            node_mib=args.node_mib, reserved_mib=args.reserved_mib,
            online_files_mib=args.online_files_mib, online_anon_mib=args.online_anon_mib,
            offline_anon_mib=args.offline_anon_mib, offline_grow_mib_s=args.offline_grow_mib_s,
            offline_task_s=args.offline_task_s,
            offline_input_mib=args.offline_input_mib,
            offline_write_every=args.offline_write_every,
            modes=modes_for([m.strip() for m in args.modes.split(",") if m.strip()],
                            v2_memory()),
            seed=args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31),
            idle_s=2.0 if args.quick else args.idle_s,
            agent_source=str(Path(args.agent_from).resolve()) if args.agent_from else "")
        for gone in sweep("coloc") + sweep("colocdata"):
            print(f"removed a cgroup left by an earlier run: {gone}")
        version = "v2" if v2_memory() else "v1"
        machine = machine_facts(version)
        print(f"machine: kernel {machine['kernel']}, {machine['cpus']} CPUs, "
              f"{machine['memory']}; memory cgroup {version}")
        print(f"node: {settings.node_mib} MiB (kubepods {settings.node_mib - settings.reserved_mib}"
              f" MiB); online: {settings.online_anon_mib} MiB anonymous + "
              f"{settings.online_files_mib} MiB of files; offline: tasks of "
              f"{settings.offline_task_s:g} s, each growing a {settings.offline_anon_mib} MiB "
              f"buffer at {settings.offline_grow_mib_s:g} MiB/s; streams "
              f"{settings.offline_input_mib} MiB, writes 1 MiB per "
              f"{settings.offline_write_every} MiB read")
        with run_dir() as scratch:
            data = Path(args.data_dir) if args.data_dir else scratch / "data"
            data.mkdir(parents=True, exist_ok=True)
            prepare_data(data, settings)
            work = Path(args.keep) if args.keep else scratch
            work.mkdir(parents=True, exist_ok=True)
            try:
                reps = asyncio.run(run(settings, data, work, keep=bool(args.keep)))
            except (KeyboardInterrupt, asyncio.CancelledError):
                print("interrupted: every cgroup and process made was removed")
                return 130
    if args.json and not args.from_json:
        Path(args.json).write_text(as_json(reps, settings, machine))
    print_table(reps, settings)
    if args.plot:
        plot(reps, Path(args.plot),
             f"{settings.node_mib} MiB node on Linux {machine['kernel']}, cgroup "
             f"{machine['cgroup']}, {machine['cpus']} CPUs; {settings.reps} x "
             f"{settings.duration_s:g} s per mode")
    print_intervals(reps, settings.seed)
    print(final_line(reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
