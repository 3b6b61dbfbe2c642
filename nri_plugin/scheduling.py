"""The agent's threads do not preempt the pods' tasks when they wake.

Under the kernel's default policy a task that wakes after a sleep is placed behind the tasks
already running and preempts the one on its CPU at once. The agent wakes some ten times a
second (its loops, the runtime's messages, the pod watch); on a node whose CPUs the pods keep
busy, each wake-up would cut into whatever request an online pod was serving on that CPU.
Under ``SCHED_BATCH`` a task keeps its fair share of CPU (its cgroup's weight, its nice value)
but a wake-up never preempts: it runs at the next scheduling tick or when the CPU frees,
a few milliseconds later at most. Nothing the agent does needs it sooner: a creation answer
has a deadline of seconds, detection windows of hundreds of milliseconds. Unlike
``SCHED_IDLE``, the agent is not starved on a saturated node, where it is needed most.

The policy is set on the calling thread and inherited by every thread it starts, so it is set
before the agent starts any. Moving from the default policy to ``SCHED_BATCH`` needs no
privilege.
"""

from __future__ import annotations

import os
from collections.abc import Callable

BATCH = "batch"
NORMAL = "normal"

POLICIES = {BATCH: os.SCHED_BATCH, NORMAL: os.SCHED_OTHER}

Setter = Callable[[int, int, os.sched_param], None]


def set_scheduling(name: str, setter: Setter = os.sched_setscheduler) -> OSError | None:
    """Put the calling thread, and so every thread it starts from now on, under the policy
    ``name`` (one of :data:`POLICIES`); the kernel's refusal, if it refused."""
    try:
        setter(0, POLICIES[name], os.sched_param(0))
    except OSError as exc:
        return exc
    return None
