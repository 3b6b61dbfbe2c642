"""What the colocation benchmark compares the agent with, and how it orders and sums up its runs.

The modes (every one runs the same workloads on the same kubelet-shaped node):

* ``unmanaged``: kubelet's defaults (node-allocatable limit on ``kubepods``, the pods' limits, CPU
  shares, oom_score_adj);
* ``static``: kubelet's QOSReserved (``--qos-reserved=memory=100%``): the BestEffort tier is
  capped at allocatable minus the requests of the Burstable and Guaranteed pods, the Burstable
  tier at allocatable minus the Guaranteed pods' requests (v1 ``memory.limit_in_bytes``, v2
  ``memory.max``);
* ``kubelet-memoryqos`` (cgroup v2 only): kubelet's MemoryQoS feature: ``memory.min`` = the
  request on the container, its pod and the tier (sum), ``memory.high`` = ``request + factor x
  (limit - request)`` on the container (``factor`` = ``memoryThrottlingFactor``, 0.9), with node
  allocatable in place of a missing limit, rounded down to pages;
* ``agent-creation``: the real agent with detection and the mitigation ladder off: its creation
  answers, the memory guard, drift repair;
* ``agent``: the real agent with every default, enforcing.

Method: repetitions come in blocks holding every mode once, each block in an order drawn from a
seeded generator (the seed is printed, so a run can be repeated); a first block is a warm-up
and is not counted. Each mode's p99 and offline throughput get a bootstrap 95 % interval over its
repetitions.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

MODES = ("unmanaged", "static", "kubelet-memoryqos", "agent-creation", "agent")
AGENT_MODES = frozenset({"agent-creation", "agent"})
V2_ONLY = frozenset({"kubelet-memoryqos"})
THROTTLING_FACTOR = 0.9
"""kubelet's default memoryThrottlingFactor."""
PAGE = 4096
BOOTSTRAP_SAMPLES = 2000


def modes_for(wanted: Sequence[str], v2: bool) -> tuple[str, ...]:
    """The wanted modes this cgroup version can run, in MODES order; unknown names refused."""
    unknown = [m for m in wanted if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; modes: {', '.join(MODES)}")
    return tuple(m for m in MODES if m in wanted and (v2 or m not in V2_ONLY))


def static_limits(allocatable: int, burstable_requests: int, guaranteed_requests: int,
                  reserve_percent: int = 100) -> dict[str, int]:
    """kubelet's QOSReserved limits of the tiers (relative cgroup -> bytes)."""
    return {
        "kubepods/besteffort": max(allocatable - (burstable_requests + guaranteed_requests)
                                   * reserve_percent // 100, 0),
        "kubepods/burstable": max(allocatable - guaranteed_requests * reserve_percent // 100, 0),
    }


def memory_high(request: int, limit: int | None, allocatable: int,
                factor: float = THROTTLING_FACTOR) -> int:
    """kubelet MemoryQoS's memory.high for a container, rounded down to pages."""
    ceiling = allocatable if limit is None else limit
    return int((request + factor * (ceiling - request)) // PAGE * PAGE)


def block_order(modes: Sequence[str], blocks: int, seed: int) -> list[tuple[str, int]]:
    """``blocks`` blocks of every mode once, each shuffled: (mode, block) pairs in run order.
    Every mode runs in every block, and across blocks each takes the early and late places
    by chance, so a machine that drifts falls on all modes alike."""
    rng = random.Random(seed)
    order: list[tuple[str, int]] = []
    for block in range(blocks):
        shuffled = list(modes)
        rng.shuffle(shuffled)
        order.extend((mode, block) for mode in shuffled)
    return order


def bootstrap_interval(values: Sequence[float], statistic: Callable[[Sequence[float]], float],
                       seed: int, samples: int = BOOTSTRAP_SAMPLES) -> tuple[float, float]:
    """The percentile bootstrap 95 % interval of ``statistic`` over ``values`` (per-repetition
    figures); (nan, nan) without values."""
    if not values:
        return math.nan, math.nan
    rng = random.Random(seed)
    stats = sorted(statistic([rng.choice(values) for _ in values]) for _ in range(samples))
    return stats[int(0.025 * (samples - 1))], stats[math.ceil(0.975 * (samples - 1))]
