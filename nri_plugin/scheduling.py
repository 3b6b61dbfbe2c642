"""The CPU scheduling policy of the agent's threads.

Under the kernel's default policy (``SCHED_OTHER``) a thread that wakes after a sleep preempts
the task running on its CPU at once. The agent wakes some ten times a second (its loops, the
runtime's messages, the pod watch). Under ``SCHED_BATCH`` a thread keeps its fair share of CPU
(its cgroup's weight, its nice value) but a wake-up never preempts: it runs at the next
scheduler tick or when the CPU frees, a few milliseconds later at most, and the agent's
wake-ups do not cut into a request an online pod is serving. Unlike ``SCHED_IDLE``, the agent
is not starved on a saturated node, where it is needed most.

``SCHED_BATCH`` is an option, not the default: in a cgroup v2 guest it did not lower an online
service's tail beside the same agent under the default policy, and the service stopped
answering for 300 ms or more beside it more often than beside any other mode, for a cause
not found (``docs/operations.md``).

The policy is set on the calling thread and inherited by every thread it starts, so it is set
before the agent starts any. Moving between the two policies needs no privilege.
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
