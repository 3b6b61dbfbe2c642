"""Running the detectors: what is read when, and from which kernel interface.

Four paths feed the readings board (through :class:`~.publisher.Publisher`):

* **periodic** (:class:`DetectorsLoop`, in a worker thread, every ``detection.interval_s``
  while memory is short, else every ``detection.quiet_interval_s`` and at once when another
  path enters a level or an online pod's own trigger fires): free memory of the system and of
  each NUMA node, kswapd's reclaim rate, RSS overuse of pods, the reclaimed tier's fulfillment,
  and each online pod's own sign of pressure: its PSI on cgroup v2, its working-set refaults on
  cgroup v1;
* **node PSI** (:class:`~.notified.NodePsi`, on the event loop): a PSI trigger on
  ``/proc/pressure/memory`` when the kernel accepts the configured (sub-second) window, else
  the cumulative stall counter polled every ``psi_poll_interval_ms``;
* **online pods' triggers** (:class:`~.triggers.PodTriggers`, cgroup v2, on the event loop): a
  PSI trigger on each online pod's ``memory.pressure``, which wakes the periodic loop.
* **memcg pressure events** (:class:`~.notified.PressureLevels`, cgroup v1, on the event
  loop): the kernel's ``memory.pressure_level`` notifications of the root memcg (reclaim for
  the whole node) and of kubelet's pods and burstable cgroups (reclaim forced by their
  limits).

Where every online pod has its trigger, the node-wide readings (free memory, kswapd, the node's
PSI) keep the periodic loop at ``interval_s``, and the node's PSI read every
``psi_poll_interval_ms`` while it holds a level, only where the ladder counts them
(``mitigation.node_signals``); elsewhere they are the wake-up of the online pods' readings and
do both (:meth:`Detection.node_paces`).

Which path each detector takes on this host is decided at start from the probe
(:class:`~reconciler.host.probe.HostInfo`) and said once (the node's PSI again after a reload of
its trigger's settings); a detector switched off in the
configuration idles, looking again every ``SWITCHED_OFF_RECHECK_S``
(:mod:`~.sections`), and resumes on reload.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import structlog

from common.aio import waker
from common.audit import AuditLog
from common.state import NodeState
from hooks.levels import QosLevel
from hooks.untrusted import bounded
from reconciler.detection import detectors as d
from reconciler.detection.config import (
    DETECTORS,
    FULFILLMENT,
    KSWAPD,
    NUMA_FREE,
    PRESSURE_LEVEL,
    PSI,
    REFAULT,
    RSS_OVERUSE,
    SYSTEM_FREE,
    DetectionConfig,
)
from reconciler.detection.counting import Counting, pod_or_memcg
from reconciler.detection.notified import NodePsi, PressureLevels
from reconciler.detection.pods import ONLINE_LEVELS, PodIndex, PodMemory
from reconciler.detection.publisher import Publisher
from reconciler.detection.sections import DetectionSections, active, paced
from reconciler.detection.signals import NODE, Board, numa_scope, pod_scope
from reconciler.detection.triggers import Arm, PodTriggers
from reconciler.host.cgroups import BESTEFFORT
from reconciler.host.numa import (
    MEMINFO,
    NODE_DIR,
    VMSTAT,
)
from reconciler.host.parse import ParseError, errno_text
from reconciler.host.probe import HostInfo
from reconciler.host.sysfs import SysFs
from reconciler.host.watermarks import Reading, Watermarks
from reconciler.loops.base import Loop, run_loop
from reconciler.loops.common import ManagedCache

log = structlog.get_logger("nri_qos.detection")

PERIODIC = (SYSTEM_FREE, NUMA_FREE, KSWAPD, RSS_OVERUSE, FULFILLMENT, PSI, REFAULT)
"""The detectors :class:`DetectorsLoop` reads files for (PSI: the pods' own pressure files)."""
POD_SCOPED = (PSI, REFAULT)
"""Detectors whose readings this loop publishes per pod (the node's PSI comes from elsewhere)."""
FAILED_PODS = pod_scope("*")
"""Scope of the unknown reading of a per-pod detector that failed as a whole."""
PRESSURE = (SYSTEM_FREE, NUMA_FREE, PSI, PRESSURE_LEVEL, KSWAPD, REFAULT)
"""The detectors whose level says memory is short now (free memory, stalls, reclaim): while none
is at a level or entering one, :class:`DetectorsLoop` looks every ``quiet_interval_s`` (the
node-wide ones only where they pace it: :meth:`Detection.node_paces`). RSS
overuse and fulfillment say how memory is shared out, which changes slowly and can stay so for
hours on a node that is not short of memory."""

RSS_LEVELS = frozenset({QosLevel.SHARED_CORES, QosLevel.RECLAIMED_CORES})


class DetectorsLoop(Loop):
    """The detectors that read files every ``detection.interval_s``."""

    name = "detection"

    def __init__(self, config: Callable[[], DetectionSections], publisher: Publisher,
                 state: NodeState, sysfs: SysFs, host: HostInfo, *,
                 audit: AuditLog | None = None, managed: ManagedCache | None = None,
                 watermarks: Watermarks | None = None,
                 node_paces: Callable[[], bool] = lambda: True) -> None:
        """``audit`` receives an ``annotation_ignored`` record per pod and unusable RSS factor
        annotation (without it the log has them); ``managed``: the running containers' cache
        the loops share (a new one when None); ``watermarks``: the zones' low watermarks as the
        agent's loops share them (None: this loop's own); ``node_paces``: whether the node-wide
        readings keep the loop at ``interval_s`` now (:meth:`Detection.node_paces`)."""
        self._config = config
        self._node_paces = node_paces
        self._audit = audit
        self._publisher = publisher
        self._sysfs = sysfs
        self._host = host
        self._pods = PodIndex(state, host.cgroup, managed)
        self._reclaim: deque[d.Reclaim] = deque()
        self._pod_stalls: dict[str, d.Stall] = {}
        self._pod_refaults: dict[str, deque[d.Refaults]] = {}
        # Each pod's memory.stat as read in this cycle (RSS overuse and refaults both read it),
        # why it could not be, or None: its cgroup went away.
        self._stats: dict[str, str | ParseError | None] = {}
        self._said: set[str] = set()
        self._watermarks = watermarks if watermarks is not None else Watermarks(sysfs)
        self._factor_problems: dict[str, str] = {}
        # Detector -> the failure whose traceback was logged: one that fails at every cycle is
        # logged once, and again once it has run without failing.
        self._failing: dict[str, str] = {}
        # Whether the loop waits out its quiet period (read from the publishing threads).
        self._quiet = False
        if not host.numa_view.consistent:
            self._say_once(NUMA_FREE, f"numa_free is off: {host.numa_view.describe()}; "
                                      "system_free covers the machine")

    def interval(self) -> float:
        seconds, self._quiet = paced(self._config(), PERIODIC, calm=not self._short())
        return seconds

    def _short(self) -> bool:
        """Whether a reading that says memory is short, and paces this loop, is at a level or
        entering one."""
        return self._publisher.engaged(PRESSURE, None if self._node_paces() else pod_or_memcg)

    def stalled(self, wake: Callable[[], None]) -> None:
        """An online pod's own trigger fired: ``wake`` the loop if it waits out its quiet
        period (a pod that keeps stalling fires every window; at ``interval_s`` the loop reads
        it anyway)."""
        if self._quiet:
            self._quiet = False
            wake()

    def subscribe_wake(self, wake: Callable[[], None]) -> Callable[[], None]:
        """A level entered on another path (the node's PSI, a memcg pressure event) while the
        loop waits out its quiet period wakes it: an online pod's own stall, which only this
        loop reads, is part of the node's, so the node's trigger or poll brings the pods' PSI
        to ``interval_s`` within its window."""
        def changed() -> None:
            if self._quiet and self._short():
                self._quiet = False
                wake()

        return self._publisher.subscribe(changed)

    def cycle(self, now: float) -> None:
        self._quiet = False
        self._stats = {}
        cfg = self._config()
        runs: list[tuple[str, Callable[[DetectionConfig, float], None]]] = [
            (SYSTEM_FREE, lambda c, t: self._system_free(c, t, self._watermarks.at(t))),
            (NUMA_FREE, lambda c, t: self._numa_free(c, t, self._watermarks.at(t))),
            (KSWAPD, self._kswapd), (RSS_OVERUSE, self._rss_overuse),
            (FULFILLMENT, self._fulfillment), (PSI, self._pod_psi),
            (REFAULT, self._refaults),
        ]
        for name, run in runs:
            if not active(cfg, name):
                self._publisher.withdraw(name, "pod:" if name in POD_SCOPED else "")
                continue
            try:
                run(cfg.detection, now)
            except Exception as exc:  # one detector's bug must not silence the others
                if self._failing.get(name) != repr(exc):
                    self._failing[name] = repr(exc)
                    log.exception("detector_failed", detector=name)
                # A per-pod detector's failure is said under a pod scope: the node's PSI
                # reading (another path's) is not replaced, and the next full round of pod
                # readings drops it.
                scope = FAILED_PODS if name in POD_SCOPED else NODE
                self._publisher.offer(name, [d.unknown(name, scope, f"detector failed: "
                                                                    f"{bounded(repr(exc))}", now)],
                                      covers=None)
            else:
                self._failing.pop(name, None)

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.info("detector_unavailable", detector=key, reason=message)

    def _system_free(self, cfg: DetectionConfig, now: float, marks: Reading) -> None:
        meminfo = self._sysfs.read(MEMINFO)
        if meminfo is None or marks.lows is None:
            sample = d.unknown(SYSTEM_FREE, NODE, f"{MEMINFO} is missing" if meminfo is None
                               else marks.problem, now)
        else:
            sample = d.system_free(meminfo, sum(marks.lows.values()),
                                   marks.watermark_scale_factor, max(len(marks.nodes), 1), cfg,
                                   now)
        self._publisher.offer(SYSTEM_FREE, [sample])

    def _numa_free(self, cfg: DetectionConfig, now: float, marks: Reading) -> None:
        # A node of memory alone fills as the kernel demotes into it: that is no pressure.
        nodes = [n for n in marks.nodes if n not in marks.far]
        if not nodes or not self._host.numa_view.consistent:
            if not nodes:
                self._say_once(NUMA_FREE, "numa_free is off: no NUMA nodes in sysfs (the "
                                          "kernel has no NUMA); system_free covers the machine")
            self._publisher.withdraw(NUMA_FREE)
            return
        if marks.lows is None:
            samples = [d.unknown(NUMA_FREE, numa_scope(n), marks.problem, now) for n in nodes]
        else:
            samples = d.numa_free({n: self._sysfs.read(f"{NODE_DIR}/node{n}/meminfo")
                                   for n in nodes}, marks.lows,
                                  marks.watermark_scale_factor, cfg, now)
        self._publisher.offer(NUMA_FREE, samples)

    def _kswapd(self, cfg: DetectionConfig, now: float) -> None:
        text = self._sysfs.read(VMSTAT)
        try:
            if text is None:
                raise ParseError(f"{VMSTAT} is missing")
            self._reclaim.append(d.read_reclaim(text, now))
        except ParseError as exc:
            self._reclaim.clear()
            self._publisher.offer(KSWAPD, [d.unknown(KSWAPD, NODE, str(exc), now)])
            return
        d.keep_window(self._reclaim, now, cfg.kswapd_window_s)
        sample = d.kswapd_sample(list(self._reclaim), cfg)
        if sample is not None:
            self._publisher.offer(KSWAPD, [sample])

    def _stat(self, pod: PodMemory) -> str | None:
        """The pod's memory.stat, read once a cycle, as :meth:`_pod_file` reads it."""
        if pod.cgroup not in self._stats:
            try:
                self._stats[pod.cgroup] = self._pod_file(pod, "memory.stat")
            except ParseError as exc:
                self._stats[pod.cgroup] = exc
        found = self._stats[pod.cgroup]
        if isinstance(found, ParseError):
            raise found
        return found

    def _pod_file(self, pod: PodMemory, name: str) -> str | None:
        """The text of the pod cgroup's file ``name``; None when the cgroup itself went away
        (the pod is leaving: no reading, nothing to say). A file missing from a cgroup still
        there (a controller not enabled for it), or one the kernel refuses to read (EACCES,
        EIO, EOPNOTSUPP ...), raises :class:`ParseError`: that pod's reading is unknown, and
        the other pods are still judged."""
        try:
            text = self._sysfs.read(f"{pod.cgroup}/{name}")
        except OSError as exc:
            raise ParseError(f"{name} unreadable: {errno_text(exc)}") from exc
        if text is None and self._sysfs.is_dir(pod.cgroup):
            raise ParseError(f"{name} is gone")
        return text

    def _rss_overuse(self, cfg: DetectionConfig, now: float) -> None:
        samples = []
        for pod in self._pods.pods():
            if pod.level not in RSS_LEVELS or pod.request_bytes <= 0:
                continue
            factor, problem = d.pod_factor(pod.annotations, cfg.rss_overuse_annotation,
                                           cfg.rss_overuse_factor)
            if problem and self._factor_problems.get(pod.uid) != problem:
                self._factor_ignored(pod, cfg.rss_overuse_annotation, problem)
            self._factor_problems[pod.uid] = problem
            try:
                stat = self._stat(pod)
            except ParseError as exc:
                samples.append(d.unknown(RSS_OVERUSE, pod_scope(pod.uid), str(exc), now,
                                         pod.uid))
                continue
            if stat is None:
                continue  # the pod is leaving
            samples.append(d.rss_overuse(pod.uid, stat, self._host.cgroup.v2,
                                         pod.request_bytes, factor, now))
        live = {s.pod_uid for s in samples}
        for uid in [u for u in self._factor_problems if u not in live]:
            del self._factor_problems[uid]
        self._publisher.offer(RSS_OVERUSE, samples)

    def _factor_ignored(self, pod: PodMemory, annotation: str, problem: str) -> None:
        log.warning("rss_overuse_annotation_ignored", pod=pod.name, pod_uid=bounded(pod.uid),
                    reason=problem)
        if self._audit is not None:
            self._audit.record("annotation_ignored", pod_uid=bounded(pod.uid),
                               annotation=bounded(annotation), reason=problem, pod=pod.name)

    def _fulfillment(self, cfg: DetectionConfig, now: float) -> None:
        layout = self._host.cgroup
        tier = layout.tier_dir("memory", BESTEFFORT)
        # Only the pods the tier's cap bounds: any pod may claim reclaimed_cores, and one of
        # another tier, which the cap never holds back, would have the tier's pods evicted
        # for a shortage of its own making.
        requests = sum(p.request_bytes for p in self._pods.pods()
                       if p.level == QosLevel.RECLAIMED_CORES and p.cgroup.startswith(tier + "/"))
        limit = self._sysfs.read(f"{tier}/{layout.limit_file}")
        sample = d.fulfillment(limit, requests, cfg, now)
        self._publisher.offer(FULFILLMENT, [] if sample is None else [sample])

    def _pod_psi(self, cfg: DetectionConfig, now: float) -> None:
        """Each online pod's own memory.pressure where pods have one (cgroup v2 with PSI on;
        the node's is the fast path's). Where PSI is off their refaults serve instead."""
        if not self._host.pod_psi:
            return
        samples: list[d.Sample] = []
        seen: dict[str, d.Stall] = {}
        for pod in self._pods.pods():
            if pod.level not in ONLINE_LEVELS:
                continue
            scope = pod_scope(pod.uid)
            try:
                text = self._pod_file(pod, "memory.pressure")
                if text is None:
                    continue  # the pod is leaving
                stall = d.read_stall(text, now)
            except ParseError as exc:
                samples.append(d.unknown(PSI, scope, str(exc), now, pod.uid))
                continue
            seen[pod.uid] = stall
            before = self._pod_stalls.get(pod.uid)
            sample = None if before is None else d.psi_sample(scope, before, stall, cfg, pod.uid)
            if sample is not None:
                samples.append(sample)
        self._pod_stalls = seen
        self._publisher.offer(PSI, samples, covers="pod:")

    def _refaults(self, cfg: DetectionConfig, now: float) -> None:
        """Each online pod's working-set refault rate, where its PSI is not read (cgroup v1)."""
        if not self._host.pod_refaults:
            self._say_once(REFAULT, "refault is off: " + (
                "each online pod's PSI counts its stalls on refaults" if self._host.pod_psi
                else "memory.stat has no workingset_refault counters (Linux 5.9+)"))
            return
        samples: list[d.Sample] = []
        kept: dict[str, deque[d.Refaults]] = {}
        for pod in self._pods.pods():
            if pod.level not in ONLINE_LEVELS:
                continue
            scope = pod_scope(pod.uid)
            try:
                stat = self._stat(pod)
                if stat is None:
                    continue  # the pod is leaving
                found = d.read_refaults(stat, self._host.cgroup.v2, now)
            except ParseError as exc:
                samples.append(d.unknown(REFAULT, scope, str(exc), now, pod.uid))
                continue
            history = kept[pod.uid] = self._pod_refaults.get(pod.uid, deque())
            history.append(found)
            d.keep_window(history, now, cfg.refault_window_s)
            sample = d.refault_sample(scope, list(history), cfg, pod.uid)
            if sample is not None:
                samples.append(sample)
        self._pod_refaults = kept
        self._publisher.offer(REFAULT, samples, covers="pod:")


class Detection:
    """Every detection path of this host, publishing on ``board`` until stop.

    ``counting``: which readings the ladder counts now (by default every kind, which keeps the
    node-wide readings pacing detection); ``arm``: how the online pods' triggers are armed (on
    their pressure files by default)."""

    def __init__(self, config: Callable[[], DetectionSections], board: Board, state: NodeState,
                 sysfs: SysFs, host: HostInfo, audit: AuditLog, *,
                 managed: ManagedCache | None = None,
                 watermarks: Watermarks | None = None,
                 counting: Callable[[], Counting] = Counting,
                 arm: Arm | None = None) -> None:
        self.publisher = Publisher(board, audit, lambda: config().detection)
        self._counting = counting
        self.triggers = PodTriggers(config, state, sysfs, host, managed=managed, arm=arm)
        self.periodic = DetectorsLoop(config, self.publisher, state, sysfs, host, audit=audit,
                                      managed=managed, watermarks=watermarks,
                                      node_paces=self.node_paces)
        self.node_psi = NodePsi(config, self.publisher, sysfs, host, node_paces=self.node_paces)
        self.pressure_levels = PressureLevels(config, self.publisher, sysfs, host)
        self._config = config

    def node_paces(self) -> bool:
        """Whether the node-wide readings pace detection: where the ladder counts them, and
        where some online pod has no trigger of its own (their level is then its wake-up)."""
        return self._counting().node or not self.triggers.complete()

    async def run(self, stop: asyncio.Event) -> None:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nri-qos-detect")
        wake = asyncio.Event()
        wake_now = waker(asyncio.get_running_loop(), wake)
        unsubscribe = self.periodic.subscribe_wake(wake_now)
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(run_loop(
                    self.periodic, stop=stop, wake=wake, executor=executor,
                    backoff_max=lambda: self._config().reconciler.backoff_max_s),
                    name="detection-periodic")
                group.create_task(self.node_psi.run(stop), name="detection-node-psi")
                group.create_task(self.triggers.run(stop, lambda: self.periodic.stalled(wake_now)),
                                  name="detection-pod-triggers")
                group.create_task(self.pressure_levels.run(stop), name="detection-pressure-level")
        finally:
            unsubscribe()
            executor.shutdown(wait=False, cancel_futures=True)
            # Readings of a detection that stopped would only mislead their readers.
            for name in DETECTORS:
                self.publisher.withdraw(name)
