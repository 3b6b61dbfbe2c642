"""What the colocation benchmark compares the agent with, and how it orders and sums up its runs.

The modes (every one runs the same workloads on the same kubelet-shaped node):

* ``unmanaged``: kubelet's defaults (node-allocatable limit on ``kubepods``, the pods' limits, CPU
  shares, oom_score_adj);
* ``static``: kubelet's QOSReserved (``--qos-reserved=memory=100%``): the BestEffort tier is
  capped at allocatable minus the requests of the Burstable and Guaranteed pods, the Burstable
  tier at allocatable minus the Guaranteed pods' requests (v1 ``memory.limit_in_bytes``, v2
  ``memory.max``);
* ``kubelet-memoryqos`` (cgroup v2 only): kubelet's MemoryQoS feature: ``memory.min`` = the
  request on the container, its pod, the tier and ``kubepods`` (sums), ``memory.high`` =
  ``request + factor x (limit - request)`` on the container (``factor`` =
  ``memoryThrottlingFactor``, 0.9), with node allocatable in place of a missing limit, rounded
  down to pages;
* ``agent-creation``: the real agent with detection and the mitigation ladder off: its creation
  answers, the memory guard, drift repair;
* ``agent``: the real agent with every default, enforcing;
* ``agent+NAME`` (``--variant NAME=FILE``): the real agent with the settings of FILE over the
  defaults, beside ``agent`` in the same run, so that a setting is judged against the defaults
  on the same machine, in the same blocks.

Method: repetitions come in blocks holding every mode once, each block in an order drawn from a
seeded generator (the seed is printed, so a run can be repeated); a first block is a warm-up
and is not counted. Each mode's p99 and offline throughput get a bootstrap 95 % interval over its
repetitions.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable, Sequence

MODES = ("unmanaged", "static", "kubelet-memoryqos", "agent-creation", "agent")
ALONE = "alone"
"""A mode run only when asked for: the online pod as unmanaged, with no offline pod on the node.
What no policy for the offline tier can beat: the online tail's floor on this machine."""
KNOWN = (ALONE, *MODES)
AGENT_MODES = frozenset({"agent-creation", "agent"})
V2_ONLY = frozenset({"kubelet-memoryqos"})
VARIANT = "agent+"
"""The prefix of a variant's mode: the agent with a variant's settings over the defaults. Not
':', which a repetition's work directory would take from the mode's name into every path under
it, and a ``KUBECONFIG`` or ``PATH`` list reads as a separator."""
VARIANT_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
THROTTLING_FACTOR = 0.9
"""kubelet's default memoryThrottlingFactor."""
PAGE = 4096
BOOTSTRAP_SAMPLES = 2000


def modes_for(wanted: Sequence[str], v2: bool, variants: Sequence[str] = ()) -> tuple[str, ...]:
    """The wanted modes this cgroup version can run, in KNOWN order, then a mode per variant
    name (``agent+NAME``, in the order given); unknown modes and malformed names refused."""
    unknown = [m for m in wanted if m not in KNOWN]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; modes: {', '.join(KNOWN)}")
    for name in variants:
        if not VARIANT_NAME.fullmatch(name):
            raise ValueError(f"variant name {name!r}: 1-32 of a-z, 0-9 and '-', starting with a "
                             f"letter or digit")
    if len(set(variants)) != len(variants):
        raise ValueError("a variant name is given twice")
    return (tuple(m for m in KNOWN if m in wanted and (v2 or m not in V2_ONLY))
            + tuple(VARIANT + name for name in variants))


def runs_agent(mode: str) -> bool:
    """A mode with the real agent: agent-creation, agent and every variant."""
    return mode in AGENT_MODES or mode.startswith(VARIANT)


def variant_of(mode: str) -> str:
    """A variant mode's name ("" for any other mode)."""
    return mode.removeprefix(VARIANT) if mode.startswith(VARIANT) else ""


def in_order(modes: Iterable[str]) -> list[str]:
    """Modes in KNOWN order, variants after them in the order first seen."""
    seen = list(dict.fromkeys(modes))
    return [m for m in KNOWN if m in seen] + [m for m in seen if m.startswith(VARIANT)]


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
