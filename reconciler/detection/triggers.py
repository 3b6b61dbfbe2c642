"""Each online pod's own PSI trigger (cgroup v2): the kernel wakes the periodic detectors when
an online pod stalls on memory.

The periodic detectors read each online pod's ``memory.pressure`` every ``quiet_interval_s``
while nothing says memory is short, so something must wake them when an online pod starts to
stall. The node's PSI can, since an online pod's stall is part of it. But the node's PSI also
counts kswapd and every offline task that reclaims, and on a node whose page cache fills its
memory it stays at a level for hours while no online pod stalls. Measured in a cgroup v2 guest
of 4 GiB beside a streaming job: the node's PSI was read ten times a second and every pod's
files every second, 4.4-5.3 CPU s of the agent's per 40 s window, while no online pod stalled and
the ladder, which does not count the node's PSI there (``mitigation.node_signals``), did
nothing.

So each online pod gets a trigger of its own on its ``memory.pressure``, with the node's
threshold and window (``psi_some_low_percent`` of ``psi_trigger_window_ms``). A trigger that
fires wakes the periodic loop, which reads the pod's counters at once. While every online pod
has one (:meth:`PodTriggers.complete`), the node-wide readings that the ladder does not count
neither keep the periodic loop at ``interval_s`` nor have the node's PSI read every
``psi_poll_interval_ms`` (:class:`~.service.Detection`). In the other cases the node's PSI wakes
them as before:

- the kernel refuses a cgroup trigger of that window (without CAP_SYS_RESOURCE some kernels
  take only multiples of 2 s);
- the node has more than :data:`MOST_TRIGGERS` online pods;
- a new pod's trigger is not armed yet.

The kernel runs one ``psimon`` thread per cgroup with a trigger, asleep until a stall begins.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

import structlog

from common.aio import sleep_until, waker
from common.state import NodeState
from hooks.events import Event
from reconciler.detection.config import PSI
from reconciler.detection.notified import trigger_spec
from reconciler.detection.pods import ONLINE_LEVELS, PodIndex
from reconciler.detection.sections import DetectionSections, active, paced
from reconciler.host.pressure import TriggerWatch
from reconciler.host.probe import HostInfo, TriggerSupport, cgroup_trigger_support
from reconciler.host.sysfs import SysFs
from reconciler.loops.common import ManagedCache

log = structlog.get_logger("nri_qos.detection")

MOST_TRIGGERS = 256
"""Online pods given a trigger of their own at most (kubelet's default is 110 pods a node):
each costs the kernel a thread; past this the node's PSI wakes the detectors."""
CHANGES = frozenset({Event.START_CONTAINER, Event.STOP_CONTAINER, Event.REMOVE_CONTAINER,
                     Event.REMOVE_POD_SANDBOX})
"""The NRI events after which the triggers are brought in line with the running pods at once
(else every ``quiet_interval_s``, and after a pod-watch change of a pod's level)."""


def pod_trigger_problem(cfg: DetectionSections, host: HostInfo,
                        support: TriggerSupport | None = None) -> str:
    """"" when online pods can have triggers of their own on ``host``, else why not.
    ``support``: what cgroups take, when probed since ``host`` was."""
    if not active(cfg, PSI):
        return "the psi detector is off"
    if not host.pod_psi:
        return "pods have no PSI of their own (cgroup v1, or PSI off)"
    support = support or host.psi.cgroup
    window_us = cfg.detection.psi_trigger_window_ms * 1000
    if support is not None and support.pending:
        return f"{support.problem}: probed again once it is"
    if support is None or support.window_us is None:
        return "the kernel refuses triggers on cgroups" + (
            f" ({support.problem})" if support is not None else "")
    if support.window_us > window_us:
        return (f"the shortest window the kernel accepts on a cgroup is "
                f"{support.window_us // 1000} ms, more than psi_trigger_window_ms")
    return ""


class Trigger(Protocol):
    def fileno(self) -> int: ...

    def gone(self) -> bool: ...

    def close(self) -> None: ...


Arm = Callable[[str, int, int], Trigger]
"""Arm a trigger on a pressure file: ``(path, stall_us, window_us)``; raises OSError when
refused."""


class PodTriggers:
    """A PSI trigger on each online pod's ``memory.pressure``, kept in line with the running
    pods. ``arm``: how a trigger is armed (a real one on the pressure file by default)."""

    def __init__(self, config: Callable[[], DetectionSections], state: NodeState,
                 sysfs: SysFs, host: HostInfo, *, managed: ManagedCache | None = None,
                 arm: Arm | None = None) -> None:
        self._config = config
        self._state = state
        self._sysfs = sysfs
        self._host = host
        # What cgroups take; probed again here while kubelet's pods cgroup was not there.
        self._support = host.psi.cgroup
        self._pods = PodIndex(state, host.cgroup, managed)
        self._arm: Arm = arm if arm is not None else (
            lambda path, stall, window: TriggerWatch(sysfs, path, stall, window))
        # Pod uid -> (its memory cgroup, the trigger's (stall, window), the trigger).
        self._armed: dict[str, tuple[str, tuple[int, int], Trigger]] = {}
        # What was last said about triggers that could not be armed, so it is said once.
        self._said = ""
        # Read from the detectors' thread: a bool, replaced whole.
        self._complete = False

    def complete(self) -> bool:
        """Whether every online pod has a trigger armed (False where pods cannot have one)."""
        return self._complete

    def armed(self) -> frozenset[str]:
        """The uids of the pods with a trigger armed."""
        return frozenset(self._armed)

    async def run(self, stop: asyncio.Event, stalled: Callable[[], None]) -> None:
        """Keep the triggers in line until ``stop``; ``stalled()`` is called on the event loop
        when one fires."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        unsubscribe = self._state.subscribe(waker(loop, changed), events=CHANGES, meta=True)
        try:
            while not stop.is_set():
                changed.clear()
                self.sync(loop, stalled)
                seconds, _quiet = paced(self._config(), (PSI,), calm=True)
                await sleep_until(seconds, stop, changed)
        finally:
            unsubscribe()
            for uid in list(self._armed):
                self._disarm(loop, uid)
            self._complete = False

    def sync(self, loop: asyncio.AbstractEventLoop, stalled: Callable[[], None]) -> None:
        """Arm a trigger for each online pod without one, and disarm those of pods gone, of
        pods no longer online, and of a window or threshold no longer configured."""
        cfg = self._config()
        if self._support is not None and self._support.pending:
            self._support = cgroup_trigger_support(self._sysfs, self._host.cgroup, self._arm)
            if not self._support.pending:
                log.info("cgroup_triggers_probed", path=self._support.path,
                         window_ms=(self._support.window_us or 0) // 1000,
                         problem=self._support.problem)
        problem = pod_trigger_problem(cfg, self._host, self._support)
        online = {} if problem else {p.uid: p.cgroup for p in self._pods.pods()
                                     if p.level in ONLINE_LEVELS}
        spec = trigger_spec(cfg.detection)
        for uid, (cgroup, armed_spec, _trigger) in list(self._armed.items()):
            if online.get(uid) != cgroup or armed_spec != spec:
                self._disarm(loop, uid)
        refused: list[str] = []
        for uid, cgroup in online.items():
            if uid in self._armed:
                continue
            if len(self._armed) >= MOST_TRIGGERS:
                refused.append(f"more than {MOST_TRIGGERS} online pods")
                continue
            try:
                trigger = self._arm(f"{cgroup}/memory.pressure", *spec)
            except OSError as exc:
                refused.append(f"{cgroup}/memory.pressure: {type(exc).__name__}: "
                               f"{exc.strerror or exc}")
                continue
            loop.add_reader(trigger.fileno(), self._fired, loop, uid, stalled)
            self._armed[uid] = (cgroup, spec, trigger)
        self._complete = not problem and not refused
        self._say(problem or (refused[0] if refused else ""))

    def _say(self, problem: str) -> None:
        if problem and problem != self._said:
            log.info("pod_triggers_unavailable", reason=problem,
                     fallback="the node's PSI wakes the periodic detectors")
        self._said = problem

    def _fired(self, loop: asyncio.AbstractEventLoop, uid: str,
               stalled: Callable[[], None]) -> None:
        entry = self._armed.get(uid)
        if entry is not None and entry[2].gone():
            # The pod's cgroup went away under its trigger: the pod is leaving. A pod still
            # listed gets a new one at the next sync, and counts as without one until then.
            self._disarm(loop, uid)
            self._complete = False
            return
        stalled()

    def _disarm(self, loop: asyncio.AbstractEventLoop, uid: str) -> None:
        _cgroup, _spec, trigger = self._armed.pop(uid)
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(trigger.fileno())
        trigger.close()
