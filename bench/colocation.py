"""Colocation: does nri-qos keep an online workload's latency beside a memory-hungry offline job?

On this machine's real kernel, a private node (:mod:`bench.kubelet_node`: a child cgroup of the
memory hierarchy with a limit, laid out as kubelet lays out its cgroups; in a ``whole_machine``
scenario, a guest's whole memory) runs the pods of a scenario (:mod:`bench.colocation_plan`,
``--scenario``, ``--list-scenarios``):

* **online**, a Burstable pod (memory request 512 MiB, limit 1 GiB, CPU request 1) of two
  processes (:mod:`bench.colocation_workloads`): a probe, fixed work per iteration touching its
  own anonymous memory and reading a file set through the page cache, every iteration's latency
  recorded; and a key-value service on a unix socket whose requests touch its own anonymous
  memory and read the same files, driven from outside the node by an open-loop load generator
  (``--online-rps``: latency from each request's due time, so queueing shows; a request not
  answered within ``--service-timeout-ms`` is counted as missed);
* **offline**, one or two BestEffort pods (no limit), started once the online one is warm: each
  runs tasks that grow anonymous memory while it streams its data set through the page cache,
  checksums every MiB (its CPU work) and writes an output; its progress (MiB read and written,
  MiB checksummed, CPU seconds spent) is recorded over time. The data set
  (``--offline-input-mib``) defaults to a size that fits beside the offline job's anonymous
  peak in what the node leaves it unmanaged, and does not once its tier is squeezed (printed).

Each repetition runs the scenario on a fresh node in one of the modes of
:mod:`bench.baselines`: ``unmanaged`` (kubelet's defaults), ``static`` (kubelet's QOSReserved
tier limits), ``kubelet-memoryqos`` (kubelet's MemoryQoS, cgroup v2), ``agent-creation`` (the
real agent, detection and ladder off) and ``agent`` (the real agent, every default, enforcing);
``alone``, only when named, is the online pod with no offline pod: the floor of its tail.
The agent is a real ``nri-qos run`` child process, configured only where the host is
(``reconciler.root``: the node), where the API server is (a fake one on loopback: the taint is
a real API write) and where the audit trail goes; the pods reach it as a runtime would bring
them: RunPodSandbox, CreateContainer (its answer applied to the container as the runtime would)
and StartContainer over the NRI protocol from the runtime simulator. Eviction stays in dry-run,
as by default. ``--agent-config FILE`` puts an operator's settings over the defaults of every
agent mode (a drop-in of the agent's configuration, refused before any run if the agent would
refuse it; printed at the top); ``--variant NAME=FILE`` adds a mode ``agent+NAME``, the agent
with FILE's settings over those, so that a setting is measured against the defaults in the
same blocks.

Method: a warm-up block of every mode (not counted), then ``--reps`` blocks of every mode once,
each block in an order drawn from ``--seed`` (printed); before each repetition the caches are
dropped and the machine left idle (``--idle-s``); each repetition writes its output into a
fresh directory. The window is the offline job's run: from its start for ``--duration``
seconds (with ``--offline-warm``, the ``streaming`` scenario's default, from once every offline
pod has read its data set through, its page cache filling the node). Printed: a table
(online probe iteration latency p50/p99/p99.9; the online container's major faults, refaults
of evicted file pages, PSI memory, io and cpu stall; how often ``kubepods`` hit its limit;
offline progress in MiB; what the agent did, from its audit records), a second (the service's
p50/p99/p99.9, misses, CPU and wait per request; the offline MiB, MiB checksummed and CPU
seconds), a third (what the offline tier paid: limit hits, refaults, major faults, PSI memory
and io stall; kswapd's scanning; the agent pod's memory; the CPU time of the benchmark's own
process, which runs the runtime simulator and the API server stand-in), a fourth (where the
CPUs went, :mod:`bench.colocation_budget`), each mode's bootstrap 95 % intervals of the
per-repetition p99 (median) and of the offline MiB (mean), and last the line
``online p99 ms: unmanaged=… static=… kubelet-memoryqos=… agent-creation=… agent=…; offline MiB:
unmanaged=… …`` (pooled p99, the service's when it ran; mean MiB per repetition; modes not run
left out). ``--plot`` draws the latency CDFs and the offline progress over time (matplotlib).

    python bench/colocation.py [--scenario NAME] [--duration 90] [--reps 3] [--quick]
                               [--modes M,M] [--seed N] [--online-rps 200]
                               [--offline-input-mib N] [--offline-work-rounds 1]
                               [--offline-warm | --no-offline-warm]
                               [--idle-s 5] [--plot PNG] [--json PATH] [--keep DIR]
                               [--data-dir DIR] [--agent-from SOURCE_TREE] [--agent-config TOML]
                               [--variant NAME=TOML ...] [--trace-stalls]
    python bench/colocation.py --from-json PATH [--plot PNG]     # the table (and plot) again

Needs root and a memory cgroup controller, and about 1.3 GB of disk under /var/tmp for the data
(written from inside a node, so their page cache is never charged to the machine). Every
cgroup, process and file made is removed at the end, also on Ctrl-C or SIGTERM; what a run
killed outright leaves (its node's cgroups with the agent in them, its directory) is removed
by the next run. ``docs/effectiveness.md`` has a documented run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import kubelet_node
from bench.baselines import block_order, memory_high, runs_agent, static_limits, variant_of
from bench.colocation_agent import READY_TIMEOUT_S, Agent, apply_adjustment
from bench.colocation_budget import party_pids, party_times, print_budget_table
from bench.colocation_cli import list_scenarios, parser, settings_from
from bench.colocation_indicators import indicator_deltas, snapshot
from bench.colocation_machine import (
    SERVICE_SOCKET,
    check_work_dirs,
    describe,
    machine_facts,
    machine_mib,
    quiet_machine,
    run_dir,
    work_prefix,
)
from bench.colocation_plan import ONLINE, SCENARIOS, PodPlan, Repetition, Settings, offline_plans
from bench.colocation_plot import plot
from bench.colocation_report import (
    as_json,
    final_line,
    from_json,
    merge_progress,
    print_cost_table,
    print_intervals,
    print_service_table,
    print_table,
    read_pairs,
    read_progress,
    read_service,
    read_work,
    rep_line,
    summarize_actions,
    timeline,
)
from bench.colocation_stalls import Sampler
from bench.kubelet_node import (
    MIB,
    Container,
    KubeletNode,
    kubelet_oom_score_adj,
    sweep,
    unavailable,
    v2_memory,
)
from protos import nri_api_pb2 as api

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = Path(__file__).with_name("colocation_workloads.py")
CPUS = os.cpu_count() or 1
SETTLE_S = 3.0
"""The online pod alone before the offline one starts: its warm baseline."""
WARM_TIMEOUT_S = 900.0
"""For an offline pod to read its data set through (``--offline-warm``): some GiB on a slow
guest's disk."""


def memory_qos(node: KubeletNode, plan: PodPlan, container: Container) -> list[str]:
    """What kubelet's MemoryQoS writes for a container (cgroup v2): memory.min = the request on
    the container, its pod, its tier and ``kubepods`` (the tier's and ``kubepods``' are sums of
    requests: one pod has a request here), and memory.high on the container unless request =
    limit (Guaranteed)."""
    request = plan.memory_request or 0
    applied = []
    if request:
        for rel in (container.rel, container.pod_rel, f"kubepods/{plan.tier}", "kubepods"):
            (node.memory / rel / "memory.min").write_text(str(request))
        applied.append(f"memory.min={request}")
    if plan.memory_limit is None or request != plan.memory_limit:
        high = memory_high(request, plan.memory_limit, node.allocatable_bytes)
        (node.memory / container.rel / "memory.high").write_text(str(high))
        applied.append(f"memory.high={high}")
    return applied


async def read_line(process: subprocess.Popen[str], timeout_s: float = READY_TIMEOUT_S) -> str:
    assert process.stdout is not None
    return await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), timeout_s)


def start_load(socket: Path, settings: Settings, out: Path) -> subprocess.Popen[str]:
    """The online service's clients: the open-loop load generator, outside the node (as from
    another machine); with ``trace_stalls`` its send times beside ``out`` (``.sent``)."""
    return subprocess.Popen(
        [sys.executable, "-I", str(WORKLOADS), "load", "--socket", str(socket), "--rps",
         str(settings.online_rps), "--timeout-ms", str(settings.service_timeout_ms), "--out",
         str(out), *(["--sent", f"{out}.sent"] if settings.trace_stalls else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def stop_load(process: subprocess.Popen[str]) -> None:
    """Stop the load generator: ``stop`` on its stdin; it writes its records and exits once the
    requests still out are answered or timed out."""
    if process.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            process.communicate("stop\n", timeout=30)
    if process.poll() is None:
        process.kill()
        process.wait()


async def repetition(mode: str, index: int, settings: Settings, data: Path,
                     work: Path) -> Repetition:
    problems: list[str] = []
    adjustments: list[str] = []
    plans = offline_plans(mode, settings.offline_pods)
    async with contextlib.AsyncExitStack() as stack:
        node = KubeletNode("coloc", settings.node_mib * MIB, settings.reserved_mib * MIB, CPUS)
        stack.callback(node.close)
        online = node.add_pod(ONLINE.tier, ONLINE.uid, ONLINE.container_id,
                              memory_limit=ONLINE.memory_limit,
                              cpu_request_milli=ONLINE.cpu_request_milli)
        offlines = [node.add_pod(p.tier, p.uid, p.container_id, memory_limit=p.memory_limit,
                                 cpu_request_milli=p.cpu_request_milli) for p in plans]
        agent = None
        if runs_agent(mode):
            agent = await stack.enter_async_context(
                Agent(node, work, Path(settings.agent_source or REPO),
                      creation_only=mode == "agent-creation", plans=(ONLINE, *plans),
                      drop_in=settings.agent_config, profile=settings.profile_agent,
                      variant=settings.variants.get(variant_of(mode), "")))
        elif mode == "static":
            burstable = sum(p.memory_request or 0 for p in (ONLINE, *plans)
                            if p.tier == "burstable")
            for rel, limit in static_limits(node.allocatable_bytes, burstable, 0).items():
                node.set_limit(rel, limit)
        online_out, service_out = work / "online.bin", work / "service.bin"
        offline_outs = [work / f"offline-{i}.txt" for i in range(len(plans))]

        async def start(plan: PodPlan, container: Container,
                        argv: list[str]) -> tuple[subprocess.Popen[str], int]:
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
            return process, oom

        online_process, online_oom = await start(ONLINE, online, [
            "online", "--files", str(data / "online"), "--anon-mib",
            str(settings.online_anon_mib), "--out", str(online_out)])
        if (await read_line(online_process)).strip() != "ready":
            raise RuntimeError("the online workload did not start")
        watched = [("online", online_process)]
        load_process = service = None
        if settings.online_rps > 0:
            # The service: a second process of the online container.
            service = node.spawn(online.rel, [
                sys.executable, "-I", str(WORKLOADS), "serve", "--files", str(data / "online"),
                "--anon-mib", str(settings.online_anon_mib), "--socket",
                str(work / SERVICE_SOCKET)], oom_score_adj=online_oom)
            if (await read_line(service)).strip() != "ready":
                raise RuntimeError("the online service did not start")
            watched.append(("online service", service))
            load_process = start_load(work / SERVICE_SOCKET, settings, service_out)
            stack.callback(stop_load, load_process)
            if (await read_line(load_process)).strip() != "ready":
                raise RuntimeError("the load generator did not start")
        sampler = None
        if settings.trace_stalls:
            sampler = Sampler(work / "tasks.txt", {n.split()[-1]: p.pid for n, p in watched} | (
                {"load": load_process.pid} if load_process else {}) | (
                {"agent": agent.pid} if agent is not None and agent.pid else {}))
            stack.callback(sampler.close)
        await asyncio.sleep(SETTLE_S)

        def open_window() -> tuple[dict[str, int | None], float, float, int, float]:
            node.pass_protection()
            return (snapshot(node, online, party_times(party_pids(watched, load_process, agent))),
                    agent.cpu_seconds() if agent is not None else 0.0,
                    time.process_time(), time.monotonic_ns(), time.time())

        window = open_window()
        for i, (plan, offline) in enumerate(zip(plans, offlines, strict=True)):
            process, _ = await start(plan, offline, [
                "offline", "--input", str(data / input_name(i)), "--output",
                str(output_file(work, i)), "--anon-mib", str(settings.offline_anon_mib),
                "--grow-mib-s", str(settings.offline_grow_mib_s), "--task-s",
                str(settings.offline_task_s), "--write-every",
                str(settings.offline_write_every), "--work-rounds",
                str(settings.offline_work_rounds), "--out", str(offline_outs[i]),
                *(["--warm"] if settings.offline_warm else [])])
            watched.append((f"offline {plan.name}", process))
            if sampler is not None:
                sampler.add(plan.name, process.pid)
        if settings.offline_warm:
            # The window opens on the node the offline pods' read-through left.
            for name, process in watched[-len(plans):]:
                if (await read_line(process, WARM_TIMEOUT_S)).strip() != "ready":
                    raise RuntimeError(f"the {name} workload did not start")
            window = open_window()
        before, cpu0, own0, t0_ns, t0_unix = window
        deadline = time.monotonic() + settings.duration_s
        while time.monotonic() < deadline:
            await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
            node.pass_protection()  # the agent's reconciler may have changed kubepods'
            for name, process in watched:
                if process.poll() is not None:
                    problems.append(f"{name} workload ended early (status {process.returncode})")
            if problems:
                break
        after = snapshot(node, online, party_times(party_pids(watched, load_process, agent)))
        cpu1 = agent.cpu_seconds() if agent is not None else 0.0
        own1 = time.process_time()
        t1_ns, t1_unix = time.monotonic_ns(), time.time()
        if load_process is not None:
            await asyncio.to_thread(stop_load, load_process)
        await asyncio.gather(*(asyncio.to_thread(node.stop, p) for _, p in reversed(watched)))
        samples = read_pairs(online_out)
        stalls = sampler.stalls(service_out, t0_ns, t1_ns,
                                settings.service_timeout_ms) if sampler is not None else []
        service_ms, missed = read_service(service_out, t0_ns, t1_ns,
                                          settings.service_timeout_ms)
        work_done = [read_work(out, t1_ns) for out in offline_outs]
        records = agent.records() if agent is not None else []
        return Repetition(
            mode=mode, index=index,
            latencies_ms=[d / 1e6 for s, d in samples if t0_ns <= s < t1_ns],
            alone_ms=[d / 1e6 for s, d in samples if s < t0_ns],
            progress=merge_progress([read_progress(out, t0_ns, t1_ns) for out in offline_outs]),
            indicators=indicator_deltas(before, after, (t1_ns - t0_ns) / 1e9),
            actions=summarize_actions(records, t0_unix, t1_unix),
            events=timeline(records, t0_unix, t1_unix),
            adjustments=adjustments, problems=problems,
            service_ms=service_ms, service_missed=missed,
            work_mib=sum(w for w, _ in work_done), work_cpu_s=sum(c for _, c in work_done),
            agent_cpu_s=cpu1 - cpu0 if agent is not None else None,
            bench_cpu_s=own1 - own0, stalls=stalls,
            agent_mib=agent.usage_mib() if agent is not None else None,
            agent_peak_mib=agent.peak_mib() if agent is not None else None)


def settings_text(toml: str) -> str:
    """A drop-in's settings on one line, for the run's header."""
    return "; ".join(line for line in toml.splitlines()
                     if line.strip() and not line.lstrip().startswith("#"))


# -- data -----------------------------------------------------------------------------------------


def input_name(pod: int) -> str:
    """The data set of offline pod ``pod`` (each pod streams its own)."""
    return "input.bin" if pod == 0 else f"input-{pod}.bin"


def prepare_data(data: Path, settings: Settings) -> None:
    """The online file set and the offline pods' data sets (``offline_input_mib`` shared among
    them), written from inside a node (its page cache charged there, never to the machine) and
    dropped from the cache; kept when already there."""
    wanted = {data / input_name(i): max(settings.offline_input_mib // settings.offline_pods, 1)
              for i in range(settings.offline_pods)}
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


# -- driving --------------------------------------------------------------------------------------


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
        work = Path(tempfile.mkdtemp(prefix=work_prefix(mode, index), dir=under))
        try:
            await asyncio.to_thread(quiet_machine, settings.idle_s)
            name = "warm-up" if index == 0 else f"repetition {index}/{settings.reps}"
            print(f"{mode} {name}: {settings.duration_s:g} s", flush=True)
            rep = await repetition(mode, index, settings, data, work)
            if index:
                reps.append(rep)
            print(rep_line(rep), flush=True)
            for problem in rep.problems:
                print(f"  {problem}", flush=True)
        finally:
            tidy(work, keep=keep, pods=settings.offline_pods)
    return reps


def output_file(work: Path, pod: int) -> Path:
    """Offline pod ``pod``'s output in a work directory: bulk data, up to the size at which the
    job's output wraps (512 MiB), and no result."""
    return work / f"output-{pod}.bin"


def tidy(work: Path, *, keep: bool, pods: int) -> None:
    """After a repetition: its work directory removed, or with ``keep`` all of it but the
    ``pods`` offline pods' outputs (kept, a fast machine's outputs filled a guest's 8 GiB
    scratch disk within a run)."""
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
        return
    for pod in range(pods):
        output_file(work, pod).unlink(missing_ok=True)


def main() -> int:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    if args.list_scenarios:
        print(list_scenarios())
        return 0
    if args.from_json:
        reps, settings, machine = from_json(Path(args.from_json).read_text())
    else:
        problem = unavailable()
        if problem:
            print(f"colocation: cannot run here ({problem})")
            print("online p99 ms: -; offline MiB: -")
            return 1
        # Absolute: the agent runs from its source tree, and is given sockets in this directory.
        keep = Path(args.keep).resolve() if args.keep else None
        try:
            settings, sizing = settings_from(args, machine_mib(), v2_memory())
            if keep is not None:
                check_work_dirs(keep, settings.modes, settings.reps)  # makes it, too
        except ValueError as exc:
            print(f"colocation: {exc}")
            print("online p99 ms: -; offline MiB: -")
            return 2
        if SCENARIOS[settings.scenario].whole_machine and settings.node_mib <= machine_mib():
            # The node is this whole machine (a guest of the scenario's size): what keeps a
            # node from putting the machine at risk has nothing left to protect.
            kubelet_node.MAX_NODE_BYTES = max(kubelet_node.MAX_NODE_BYTES,
                                              settings.node_mib * MIB)
        for gone in sweep("coloc") + sweep("colocdata"):
            print(f"removed a cgroup left by an earlier run: {gone}")
        version = "v2" if v2_memory() else "v1"
        machine = machine_facts(version, CPUS)
        print(describe(machine))
        print(f"scenario {settings.scenario}: {SCENARIOS[settings.scenario].summary}")
        if settings.agent_config:
            print("the agent modes' configuration: the defaults, and over them (--agent-config): "
                  + settings_text(settings.agent_config))
        for name, text in settings.variants.items():
            print(f"mode agent+{name}: the agent with, over that: {settings_text(text)}")
        print(f"node: {settings.node_mib} MiB (kubepods {settings.node_mib - settings.reserved_mib}"
              f" MiB); online: {settings.online_anon_mib} MiB anonymous + "
              f"{settings.online_files_mib} MiB of files"
              + (f", and a key-value service of as much anonymous memory at "
                 f"{settings.online_rps:g} requests/s" if settings.online_rps > 0 else "")
              + f"; offline: {settings.offline_pods} pod(s), tasks of "
              f"{settings.offline_task_s:g} s, each growing a {settings.offline_anon_mib} MiB "
              f"buffer at {settings.offline_grow_mib_s:g} MiB/s; streams "
              f"{settings.offline_input_mib} MiB"
              + (" (read through once before each window)" if settings.offline_warm else "")
              + ", writes 1 MiB per "
              f"{settings.offline_write_every} MiB read, SHA-256 x "
              f"{settings.offline_work_rounds} per MiB")
        print(sizing)
        with run_dir() as scratch:
            data = Path(args.data_dir) if args.data_dir else scratch / "data"
            data.mkdir(parents=True, exist_ok=True)
            prepare_data(data, settings)
            try:
                reps = asyncio.run(run(settings, data, keep or scratch, keep=keep is not None))
            except (KeyboardInterrupt, asyncio.CancelledError):
                print("interrupted: every cgroup and process made was removed")
                return 130
    if args.json and not args.from_json:
        Path(args.json).write_text(as_json(reps, settings, machine))
    print_table(reps, settings)
    print_service_table(reps, settings)
    print_cost_table(reps)
    print_budget_table(reps, machine["cpus"])
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
