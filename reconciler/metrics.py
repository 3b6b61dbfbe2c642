"""The reconciler's series: its loops' cycles, the memory guard, the mitigation ladder, drop
cache, NUMA balance, evictions, the node taint, and the detectors, resctrl groups and offloaded
pods read at scrape time.

:class:`ReconcilerMetrics` defines them in the registry the composition root hands it (that of
:class:`common.metrics.Metrics`, so one endpoint renders everything). Recorded series are kept
by the code that does the work (``loop_cycle``, ``eviction`` ...); sources registered with
``watch_*`` are read when the endpoint is scraped, in a worker thread, so a source may read
files. Label values are bounded: loops, detectors and results come from fixed sets in the code;
scopes and resctrl groups name pods only where the count is the node's pods. This module sits at
the bottom of the reconciler's layers (it imports nothing of the reconciler), so any layer may
record into it; sources from higher layers are typed structurally.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.metrics import PREFIX, new_registry

CYCLE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
"""Seconds of one reconciler cycle."""

STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds of one NUMA balance step (a child process's start is part of it)."""
BALANCE_RESULTS = ("done", "timeout", "failed")


class ReadingLike(Protocol):
    """What the detector-level collector reads of a reading (see reconciler.detection.signals)."""

    @property
    def detector(self) -> str: ...

    @property
    def scope(self) -> str: ...

    @property
    def level(self) -> int: ...

    @property
    def pod_uid(self) -> str | None: ...


class ReadingSource(Protocol):
    """The detection board, as far as metrics read it."""

    def current(self) -> Iterable[ReadingLike]: ...


class ResctrlUsageLike(Protocol):
    """One resctrl group's monitoring counters in one L3 domain (see reconciler.host.resctrl_mon);
    None where the kernel reports the counter unavailable."""

    @property
    def group(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def domain(self) -> str: ...

    @property
    def llc_occupancy_bytes(self) -> int | None: ...

    @property
    def mbm_total_bytes(self) -> int | None: ...

    @property
    def mbm_local_bytes(self) -> int | None: ...

    @property
    def pod_uid(self) -> str | None: ...


class PodOffloadLike(Protocol):
    @property
    def pod_uid(self) -> str: ...

    @property
    def offloaded_bytes(self) -> int: ...

    @property
    def stall_us(self) -> int: ...

    @property
    def refaults_per_s(self) -> float: ...


PodNames = Callable[[], Mapping[str, tuple[str, str]]]
"""uid -> (namespace, name) of the pods the agent knows now."""


class ReconcilerMetrics:
    """The reconciler's series and the methods that record them, in ``registry`` (a fresh one
    when None); safe to call from any thread."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
        self._cycle_duration = Histogram(
            f"{PREFIX}_reconciler_cycle_duration_seconds",
            "Duration of one reconciler cycle, per loop.", ["loop"], buckets=CYCLE_BUCKETS,
            registry=r)
        self._cycle_failures = Counter(
            f"{PREFIX}_reconciler_cycle_failures_total",
            "Reconciler cycles that raised, per loop.", ["loop"], registry=r)
        # -- memory ----------------------------------------------------------------------------
        # Absent, not 0, until the guard holds a cap: 0 would read as "no memory allowed".
        self._guard_cap = _OptionalGauge(
            f"{PREFIX}_memory_guard_cap_bytes", "Memory cap the guard set on the reclaimed tier.")
        r.register(self._guard_cap)
        self._tier_usage = Gauge(
            f"{PREFIX}_reclaimed_tier_usage_bytes",
            "Memory usage of the reclaimed tier, as the guard last read it.", registry=r)
        self._ladder_level = Gauge(
            f"{PREFIX}_mitigation_ladder_level",
            "Level the mitigation ladder acts on: 0 none, 1 low, 2 medium, 3 high.", registry=r)
        self._drop_cache_runs = Counter(
            f"{PREFIX}_drop_cache_runs_total", "Drop-cache actions, per result.", ["result"],
            registry=r)
        self._drop_cache_freed = Counter(
            f"{PREFIX}_drop_cache_freed_bytes_total",
            "Memory freed by drop-cache actions.", registry=r)
        self._squeeze_judgments = Counter(
            f"{PREFIX}_squeeze_judgments_total",
            "Squeezes of the reclaimed tier judged, per verdict (relieved: kept; futile: "
            "released and held off).", ["verdict"], registry=r)
        self._balance_steps = Counter(
            f"{PREFIX}_numa_balance_steps_total",
            "NUMA balance steps, per result (done, timeout, failed).", ["result"], registry=r)
        self._balance_bytes = Counter(
            f"{PREFIX}_numa_balance_moved_bytes_total",
            "Memory NUMA balance steps moved off nodes under their watermark.", registry=r)
        self._balance_duration = Histogram(
            f"{PREFIX}_numa_balance_step_duration_seconds",
            "Duration of one NUMA balance step.", buckets=STEP_BUCKETS, registry=r)
        self._evictions = Counter(
            f"{PREFIX}_evictions_total",
            "Evictions asked for, per eviction plugin and result.", ["plugin", "result"],
            registry=r)
        self._taints = Gauge(
            f"{PREFIX}_node_taint",
            "1 while this agent's taint is on the node, per taint key.", ["taint"], registry=r)

    def loop_cycle(self, loop: str, seconds: float, *, failed: bool) -> None:
        """One reconciler cycle of ``loop`` ended after ``seconds`` (``failed``: it raised)."""
        self._cycle_duration.labels(loop).observe(seconds)
        if failed:
            self._cycle_failures.labels(loop).inc()

    def memory_guard(self, cap_bytes: int | None, usage_bytes: int) -> None:
        """The guard's cap on the reclaimed tier (None: it holds none) and the tier's usage,
        after a cycle."""
        self._guard_cap.value = cap_bytes
        self._tier_usage.set(usage_bytes)

    def ladder_level(self, level: int) -> None:
        """The mitigation ladder acts on ``level`` now (0: none, no rung engaged)."""
        self._ladder_level.set(level)

    def drop_cache(self, result: str, freed_bytes: int) -> None:
        """One drop-cache action ended with ``result`` (a fixed word such as ``done``,
        ``short``, ``timeout``, ``failed``) after freeing ``freed_bytes``."""
        self._drop_cache_runs.labels(result).inc()
        if freed_bytes > 0:
            self._drop_cache_freed.inc(freed_bytes)

    def squeeze_judged(self, relieved: bool) -> None:
        """The tune rung judged its squeeze: it relieved the pod that engaged it, or not."""
        self._squeeze_judgments.labels("relieved" if relieved else "futile").inc()

    def numa_balance_step(self, result: str, moved_bytes: int, seconds: float) -> None:
        """One NUMA balance step ended with ``result`` (``done``, ``timeout``, ``failed``; held
        steps are not counted) after moving ``moved_bytes`` in ``seconds``."""
        if result not in BALANCE_RESULTS:
            raise ValueError(f"unknown NUMA balance result {result!r}")
        self._balance_steps.labels(result).inc()
        self._balance_duration.observe(seconds)
        if moved_bytes > 0:
            self._balance_bytes.inc(moved_bytes)

    def eviction(self, plugin: str, result: str) -> None:
        """An eviction asked for by ``plugin`` ended with ``result`` (an EvictionOutcome value,
        or ``dry_run``)."""
        self._evictions.labels(plugin, result).inc()

    def taint(self, key: str, present: bool) -> None:
        """This agent's taint ``key`` is now on the node (or was removed)."""
        self._taints.labels(key).set(1 if present else 0)

    def watch_board(self, board: ReadingSource, pods: PodNames = dict) -> None:
        """Export each detector's latest level per scope (-1 unknown, 0 none ... 3 high); a
        pod's scope with the pod's ``namespace`` and ``pod`` from ``pods``."""
        self.registry.register(_BoardCollector(board, pods))

    def watch_resctrl(self, read: Callable[[], Iterable[ResctrlUsageLike]],
                      pods: PodNames = dict) -> None:
        """Export resctrl monitoring (LLC occupancy, MBM bytes) of our groups, read at scrape
        time through ``read``; a pod's group with the pod's ``namespace`` and ``pod``."""
        self.registry.register(_ResctrlCollector(read, pods))

    def watch_offload(self, read: Callable[[], Iterable[PodOffloadLike]],
                      pods: PodNames = dict) -> None:
        """Export what the offloading loop did per pod, read at scrape time through ``read``,
        with the pod's ``namespace`` and ``pod`` from ``pods``."""
        self.registry.register(_OffloadCollector(read, pods))


class _OffloadCollector(Collector):
    def __init__(self, read: Callable[[], Iterable[PodOffloadLike]], pods: PodNames) -> None:
        self._read = read
        self._pods = pods

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["pod_uid", "namespace", "pod"]
        pods = self._pods()
        offloaded = CounterMetricFamily(
            f"{PREFIX}_offload_reclaimed_bytes",
            "Memory the offloading loop reclaimed from a pod's containers.", labels=labels)
        stall = CounterMetricFamily(
            f"{PREFIX}_offload_stall_seconds",
            "Memory stall (memory.pressure some) of a pod's containers in the cycles that "
            "followed an offloading step: the cost the steps may have added.", labels=labels)
        refaults = GaugeMetricFamily(
            f"{PREFIX}_offload_refaults_per_second",
            "Refaults of a pod's offloaded containers per second, at their last cycle.",
            labels=labels)
        for pod in self._read():
            values = [pod.pod_uid, *_names(pods, pod.pod_uid)]
            offloaded.add_metric(values, pod.offloaded_bytes)
            stall.add_metric(values, pod.stall_us / 1e6)
            refaults.add_metric(values, pod.refaults_per_s)
        yield offloaded
        yield stall
        yield refaults


class _OptionalGauge(Collector):
    """A gauge without labels that is exported only once it has a value."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name = name
        self._documentation = documentation
        self.value: float | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        value = self.value
        if value is not None:
            yield GaugeMetricFamily(self._name, self._documentation, value=value)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self._name, self._documentation)


def _names(pods: Mapping[str, tuple[str, str]], uid: str | None) -> list[str]:
    """``namespace`` and ``pod`` label values, the labels kube-state-metrics puts on a pod's
    series: empty (no label, for Prometheus) where no pod or an unknown one is concerned, so a
    pod's labels go with its series when it goes."""
    return list(pods.get(uid, ("", ""))) if uid else ["", ""]


class _BoardCollector(Collector):
    def __init__(self, board: ReadingSource, pods: PodNames) -> None:
        self._board = board
        self._pods = pods

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            f"{PREFIX}_detector_level",
            "Latest level per detector and scope: -1 unknown, 0 none, 1 low, 2 medium, 3 high; "
            "a pod's scope also by namespace and pod.",
            labels=["detector", "scope", "namespace", "pod"])
        pods = self._pods()
        for reading in self._board.current():
            family.add_metric([reading.detector, reading.scope, *_names(pods, reading.pod_uid)],
                              int(reading.level))
        yield family


class _ResctrlCollector(Collector):
    def __init__(self, read: Callable[[], Iterable[ResctrlUsageLike]], pods: PodNames) -> None:
        self._read = read
        self._pods = pods

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["group", "kind", "domain", "namespace", "pod"]
        pods = self._pods()
        llc = GaugeMetricFamily(f"{PREFIX}_resctrl_llc_occupancy_bytes",
                                "L3 cache occupied by a resctrl group's tasks, per L3 domain.",
                                labels=labels)
        total = CounterMetricFamily(f"{PREFIX}_resctrl_mbm_total_bytes",
                                    "Memory traffic of a resctrl group (MBM total), per L3 domain.",
                                    labels=labels)
        local = CounterMetricFamily(f"{PREFIX}_resctrl_mbm_local_bytes",
                                    "Memory traffic of a resctrl group to its local NUMA node "
                                    "(MBM local), per L3 domain.", labels=labels)
        for usage in self._read():
            values = [usage.group, usage.kind, usage.domain, *_names(pods, usage.pod_uid)]
            if usage.llc_occupancy_bytes is not None:
                llc.add_metric(values, usage.llc_occupancy_bytes)
            if usage.mbm_total_bytes is not None:
                total.add_metric(values, usage.mbm_total_bytes)
            if usage.mbm_local_bytes is not None:
                local.add_metric(values, usage.mbm_local_bytes)
        yield llc
        yield total
        yield local
