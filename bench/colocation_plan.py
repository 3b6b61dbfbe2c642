"""The colocation benchmark's plans: the pods, the settings of a run and one repetition's record
(:mod:`bench.colocation`)."""

from __future__ import annotations

import dataclasses

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

