"""The colocation benchmark's plans: the pods, the scenarios, the settings of a run and one
repetition's record (:mod:`bench.colocation`).

Scenarios are data: each names a node size and the workloads' shape, and feeds the same script
(``--scenario NAME``; ``--list-scenarios``). Only ``main`` (a 3 GiB node memcg, on any machine)
was ever looked at while the agent's defaults were chosen; the others are held out, and each is a
node that is a whole machine (a guest of that size), so that global reclaim, kswapd and the
memory guard's own computation are those of a real node.
"""

from __future__ import annotations

import dataclasses

from bench.baselines import ALONE
from bench.kubelet_node import GIB, MIB


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
OFFLINE_2 = PodPlan("etl-1", "batch", "0c010c01-0000-4000-8000-000000000003", "c3" * 32,
                    "besteffort", None, None, 0)
OFFLINE_PODS = (OFFLINE, OFFLINE_2)
AGENT = PodPlan("nri-qos-bench", "kube-system", "0c010c01-0000-4000-8000-00000000a6e7",
                "d4" * 32, "burstable", 96 * MIB, 256 * MIB, 50)
"""The agent's own pod in the agent modes, with the requests and limit of the DaemonSet in
``deploy/kustomize/base/daemonset.yaml``: on a node the runtime lists its container at
Synchronize and the API server its pod, so the agent protects it as it does any online pod."""
INTERPRETER_MIB = 16
"""What one workload process holds beside its data (the interpreter, its heap)."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    node_mib: int
    # The node is the whole machine (a guest of that size): its memcg is the machine's memory,
    # so global reclaim, kswapd and the guard's own computation are what a real node has.
    whole_machine: bool = False
    online_anon_mib: int = 64
    online_files_mib: int = 256
    offline_pods: int = 1
    offline_anon_mib: int = 2048
    offline_grow_mib_s: float = 1024.0
    offline_task_s: float = 6.0
    # The default offline data set, as a share of the room the node leaves the offline job
    # unmanaged (below 1: it fits there; above 1: it streams through the page cache).
    input_share: float = 0.8
    # A data set of this size instead (MiB; 0: ``input_share`` of the room), for a node that
    # leaves the offline job no room at all.
    input_mib: int = 0
    # Each offline pod reads its data set through once before the window opens, so that the
    # window starts on a node its page cache fills, as a job that has streamed for a while
    # leaves it; without, a job that reads about 1 GiB a window on a slow guest (TCG) never
    # fills its room within one.
    warm: bool = False


SCENARIOS = {s.name: s for s in (
    Scenario("main", "a 3 GiB node memcg; one offline job of 6 s tasks each growing a 2 GiB "
             "buffer while it streams and checksums its data set", 3072),
    Scenario("node-4g", "main's workloads on a node that is a whole 4 GiB machine (a guest)",
             4096, whole_machine=True),
    Scenario("node-8g", "main's workloads on a node that is a whole 8 GiB machine (a guest)",
             8192, whole_machine=True),
    # The held-out workloads, each on a whole 4 GiB machine.
    Scenario("streaming", "the offline job streams a data set larger than its room in the node "
             "and never grows anonymous memory; each window opens once it has read its data "
             "set through once, its page cache filling the node", 4096, True,
             offline_anon_mib=0, input_share=1.5, warm=True),
    Scenario("growing-anon", "the offline job grows anonymous memory steadily (32 MiB/s, never "
             "freed) while it streams", 4096, True, offline_anon_mib=3072,
             offline_grow_mib_s=32.0, offline_task_s=1e9),
    Scenario("two-offline", "two offline pods, each of 6 s tasks growing a 1 GiB buffer",
             4096, True, offline_pods=2, offline_anon_mib=1024),
    Scenario("anon-online", "the online pod's working set is mostly anonymous (384 MiB per "
             "process, 32 MiB of files)", 4096, True, online_anon_mib=384,
             online_files_mib=32),
    Scenario("held-anon", "the offline job takes 3000 MiB of anonymous memory in its first "
             "seconds and keeps it, beside the online pod's 640 MiB of files: more than the node "
             "has, so the kernel can only reclaim page cache, the online pod's included", 4096,
             True, online_files_mib=640, offline_anon_mib=3000, offline_grow_mib_s=256.0,
             offline_task_s=1e9, input_mib=400),
)}


def offline_plans(mode: str, pods: int) -> tuple[PodPlan, ...]:
    """The offline pods a repetition of ``mode`` runs: the scenario's ``pods``, none alone."""
    return () if mode == ALONE else OFFLINE_PODS[:pods]


def anon_peak_mib(anon_mib: int, grow_mib_s: float, task_s: float, duration_s: float) -> int:
    """The most anonymous memory one offline task holds in a window."""
    return int(min(anon_mib, grow_mib_s * min(task_s, duration_s)))


def online_held_mib(anon_mib: int, files_mib: int, service: bool) -> int:
    """What the online pod holds: the probe's (and the service's) anonymous memory, the file
    set's page cache (shared by both), each process's interpreter."""
    processes = 2 if service else 1
    return anon_mib * processes + files_mib + INTERPRETER_MIB * processes


def default_input_mib(allocatable_mib: int, online_mib: int, offline_peak_mib: int, pods: int,
                      share: float) -> tuple[int, int]:
    """The offline data set (MiB, all pods together) as ``share`` of the room the node leaves
    the offline pods unmanaged (allocatable less what the online pod holds and the offline
    pods' own anonymous peaks and interpreters); also that room."""
    room = allocatable_mib - online_mib - pods * (offline_peak_mib + INTERPRETER_MIB)
    return max(int(room * share), 64 * pods), room


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
    # Settings over the defaults for every agent mode: the text of a TOML drop-in ("" for none).
    agent_config: str = ""
    # Each variant's settings over those (name -> the text of a TOML drop-in): its mode is
    # ``agent+NAME``, the full agent with them.
    variants: dict[str, str] = dataclasses.field(default_factory=dict)
    # Of the blocks' order (printed, so that a run can be repeated).
    seed: int = 0
    # Before each repetition: caches dropped, then this long idle.
    idle_s: float = 5.0
    scenario: str = "main"
    offline_pods: int = 1
    # SHA-256 rounds per MiB the offline job reads: its CPU work.
    offline_work_rounds: int = 1
    # The window opens once every offline pod has read its data set through (Scenario.warm).
    offline_warm: bool = False
    # The online key-value service's open-loop load (0: no service) and its miss timeout.
    online_rps: float = 200.0
    service_timeout_ms: float = 1000.0
    # What the machine's tasks did over each of the service's stalls (bench.colocation_stalls).
    trace_stalls: bool = False
    # Each agent's threads profiled into its work directory (bench/agent_profile.py).
    profile_agent: bool = False


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
    # The online service: latency (ms, from each request's due time) of the requests due in the
    # window and answered within the timeout, the others counted as missed.
    service_ms: list[float] = dataclasses.field(default_factory=list)
    service_missed: int = 0
    # The offline pods' work in the window: MiB checksummed, CPU seconds spent on it.
    work_mib: float = 0.0
    work_cpu_s: float = 0.0
    # The agent's own CPU seconds in the window (None: no agent in this mode).
    agent_cpu_s: float | None = None
    # The most memory the agent's pod held (MiB; None: no agent, or the kernel does not say).
    agent_peak_mib: float | None = None
    # The agent pod's memory at the window's end: the peak also counts what starting it read.
    agent_mib: float | None = None
    # The benchmark process's own CPU seconds in the window: the runtime simulator and the API
    # server stand-in work for the agent, so they count against the agent modes.
    bench_cpu_s: float | None = None
    # Each stall of the service, with what the sampled tasks did over it (--trace-stalls).
    stalls: list[str] = dataclasses.field(default_factory=list)

    @property
    def offline_mb(self) -> float:
        return self.progress[-1][1] if self.progress else 0.0

