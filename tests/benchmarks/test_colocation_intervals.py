"""The benchmark's 95 % intervals: the percentile bootstrap, and repetitions whose service left
requests unanswered (an infinite p99)."""

from __future__ import annotations

import math
from typing import Any

from bench.baselines import bootstrap_interval
from bench.colocation_plan import Repetition
from bench.colocation_report import intervals, percentile, summarize_actions, timeline


def rep(mode: str, index: int, service_ms: list[float], missed: int) -> Repetition:
    return Repetition(mode=mode, index=index, latencies_ms=[1.0] * 100, alone_ms=[],
                      progress=[(0.0, 0.0), (1.0, 10.0)], indicators={}, actions={}, events=[],
                      adjustments=[], problems=[], service_ms=service_ms, service_missed=missed)


def test_bootstrap_interval() -> None:
    values = [10.0, 11.0, 12.0, 13.0, 30.0]
    low, high = bootstrap_interval(values, lambda v: sorted(v)[len(v) // 2], seed=1)
    assert min(values) <= low <= 12.0 <= high <= max(values)
    assert bootstrap_interval([5.0] * 4, lambda v: sum(v) / len(v), seed=1) == (5.0, 5.0)
    nothing = bootstrap_interval([], lambda v: 0.0, seed=1)
    assert nothing[0] != nothing[0]  # NaN


def test_repetitions_with_unanswered_requests_give_an_ordered_interval() -> None:
    inf = math.inf
    # a repetition whose service missed requests has an infinite p99: no NaN from it
    assert percentile([1.0, 2.0, inf], 0.5) == 2.0
    assert percentile([1.0, inf, inf], 0.5) == inf
    assert percentile([1.0, 3.0, inf, inf], 0.5) == inf
    assert percentile([1.0, 3.0, 5.0, inf], 0.5) == 4.0
    reps = [rep("static", index, [50.0 + index] * 1000, missed)
            for index, missed in enumerate((0, 0, 0, 0, 0, 300, 300, 300))]
    low, high = intervals(reps, seed=3)["static"]["p99"]
    assert 50.0 <= low <= high
    assert high == inf  # 3 of 8 infinite: a resample's median can be too


def test_the_agents_actions_in_the_window_are_counted() -> None:
    records: list[tuple[float, str, dict[str, Any]]] = [
        (0.5, "mitigation_action", {"action": "tune", "step": "engage", "result": "done"}),
        (1.0, "mitigation_action", {"action": "tune", "step": "engage", "result": "done"}),
        (2.0, "memory_guard_cap", {"squeezed": True}),
        (2.5, "memory_guard_cap", {"squeezed": False}),
        (3.0, "squeeze_judged", {"verdict": "futile"}),
        (4.0, "mitigation_level", {"ladder_level": "low"}),
        (5.0, "taint_added", {}),
        (9.0, "squeeze_judged", {"verdict": "relieved"}),
    ]
    assert summarize_actions(records, 1.0, 5.0) == {
        "tune engage done": 1, "squeeze limit writes": 1, "squeeze futile": 1,
        "ladder level low": 1, "taint_added": 1}


def test_the_timeline_names_each_squeeze_by_what_holds_the_tier() -> None:
    """v1: the limit; v2: memory.high, whether memory.max is a standing cap or none."""
    records: list[tuple[float, str, dict[str, Any]]] = [
        (1.0, "memory_guard_cap", {"squeezed": True, "cap_bytes": 2048 << 20}),
        (2.0, "memory_guard_cap", {"squeezed": True, "cap_bytes": 3072 << 20,
                                   "high_bytes": 1024 << 20}),
        (3.0, "memory_guard_cap", {"squeezed": True, "cap_bytes": None,
                                   "high_bytes": 512 << 20}),
        (4.0, "memory_guard_cap", {"squeezed": False, "cap_bytes": None, "high_bytes": 0}),
    ]
    assert timeline(records, 0.5, 10.0) == [
        (0.5, "squeeze to 2048 MiB"), (1.5, "squeeze to 1024 MiB"), (2.5, "squeeze to 512 MiB")]
