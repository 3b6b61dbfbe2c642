"""Every Prometheus series the agent exports, in one registry of its own, and how to record them.

:class:`Metrics` owns a :class:`~prometheus_client.CollectorRegistry` (never the library's global
default registry: tests and two agents in one process stay apart) and defines each series once,
with its unit in the name and a fixed, small label set. The composition root creates one
:class:`Metrics` and hands it to what records into it; the HTTP endpoint
(:mod:`nri_plugin.report.metrics_server`) only renders :attr:`Metrics.registry`.

Two ways in:

* **recorded**: the code that does the work calls a method (``nri_request``, ``loop_cycle``,
  ``host_write`` ...). Hot-path methods keep the labelled children they resolved once, so a call
  costs a dict lookup and the increments;
* **collected at scrape time**: sources registered with ``watch_*`` are read when the endpoint is
  scraped (the detection board, the node's pod counts, resctrl monitoring counters). The endpoint
  renders in a worker thread, so a source may read files.

Label values are bounded: events, loops, file names, fields, detectors and results come from
fixed sets in the code; scopes and resctrl groups name pods only where the count is the node's
pods. This module sits at the bottom of the reconciler's layers (it imports nothing of the
project), so any layer may record into it; sources from higher layers are typed structurally.
"""

from __future__ import annotations

import platform
import posixpath
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "nri_qos"

NRI_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 1.0, 2.5)
"""Seconds; 0.1-5 ms resolved finely (where answers are), then up to the runtime's 2 s timeout."""
CYCLE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
"""Seconds of one reconciler cycle."""

STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds of one NUMA balance step (a child process's start is part of it)."""
BALANCE_RESULTS = ("done", "timeout", "failed")

NRI_RESULTS = ("ok", "fail-open", "error")
"""How an NRI request was answered: everything applied; answered with what worked (a capability
failed or missed its deadline, or the input was unusable); an error status."""
CONNECTION_STATES = ("disconnected", "connected", "synchronized")
"""The runtime connection: no socket; registered and being configured or synchronized; serving
events."""


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


class Metrics:
    """The agent's series and the methods that record them; safe to call from any thread."""

    def __init__(self, version: str = "unknown") -> None:
        # A counter's ``_created`` series doubles every counter for a value nobody queries.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # the library's own stub
        self.registry = CollectorRegistry()
        r = self.registry
        # The agent's own process (its /proc/self): resident memory, CPU seconds, open fds.
        ProcessCollector(registry=r)
        Gauge(f"{PREFIX}_build_info", "1, labelled with the agent's and Python's versions.",
              ["version", "python"], registry=r).labels(
                  version, platform.python_version()).set(1)
        self._reloads = Counter(
            f"{PREFIX}_config_reloads_total",
            "Configuration loads, at start and on every reload, per result (success, failure).",
            ["result"], registry=r)
        for result in ("success", "failure"):
            self._reloads.labels(result)
        self._reload_success = Gauge(
            f"{PREFIX}_config_last_reload_success_timestamp_seconds",
            "Unix time of the last configuration load that took effect.", registry=r)
        # -- NRI -------------------------------------------------------------------------------
        self._nri_duration = Histogram(
            f"{PREFIX}_nri_request_duration_seconds",
            "Time from reading an NRI request to having its answer, per event.",
            ["event"], buckets=NRI_BUCKETS, registry=r)
        self._nri_requests = Counter(
            f"{PREFIX}_nri_requests_total", "NRI requests answered, per event and result "
            "(ok, fail-open, error).", ["event", "result"], registry=r)
        self._nri_adjusted = Counter(
            f"{PREFIX}_nri_adjusted_fields_total",
            "CreateContainer answers that set a field, per field.", ["field"], registry=r)
        self._levels_refused = Counter(
            f"{PREFIX}_qos_level_refused_total",
            "QoS level claims refused (above the pod's class, namespace or level at creation), "
            "per source.", ["source"], registry=r)
        self._nri_state = Gauge(
            f"{PREFIX}_nri_connection_state",
            "1 for the state the runtime connection is in (disconnected, connected, "
            "synchronized), 0 for the others.", ["state"], registry=r)
        self._nri_state_since = Gauge(
            f"{PREFIX}_nri_connection_state_timestamp_seconds",
            "Unix time the runtime connection entered its current state.", registry=r)
        self._nri_reconnects = Counter(
            f"{PREFIX}_nri_reconnects_total",
            "Connections to the runtime after the first one.", registry=r)
        self._nri_runtime = Info(
            f"{PREFIX}_nri_runtime", "The runtime this agent is registered with.", registry=r)
        for state in CONNECTION_STATES:
            self._nri_state.labels(state).set(1 if state == "disconnected" else 0)
        # Labelled children resolved once: labels() costs more than the increment.
        self._nri_children: dict[tuple[str, str], tuple[Histogram, Counter]] = {}
        self._adjusted_children: dict[str, Counter] = {}
        # -- reconciler ------------------------------------------------------------------------
        self._cycle_duration = Histogram(
            f"{PREFIX}_reconciler_cycle_duration_seconds",
            "Duration of one reconciler cycle, per loop.", ["loop"], buckets=CYCLE_BUCKETS,
            registry=r)
        self._cycle_failures = Counter(
            f"{PREFIX}_reconciler_cycle_failures_total",
            "Reconciler cycles that raised, per loop.", ["loop"], registry=r)
        self._writes = Counter(
            f"{PREFIX}_host_writes_total",
            "Writes to cgroup, procfs and resctrl files, per file name and outcome (written, "
            "unchanged, gone, failed).", ["file", "outcome"], registry=r)
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

    # -- NRI -------------------------------------------------------------------------------------

    def nri_request(self, event: str, result: str, seconds: float) -> None:
        """One NRI request answered: ``event`` in lower case (``create_container``), ``result``
        one of :data:`NRI_RESULTS`."""
        key = (event, result)
        children = self._nri_children.get(key)
        if children is None:
            if result not in NRI_RESULTS:
                raise ValueError(f"unknown NRI result {result!r}")
            children = (self._nri_duration.labels(event), self._nri_requests.labels(event, result))
            self._nri_children[key] = children
        children[0].observe(seconds)
        children[1].inc()

    def nri_adjusted(self, fields: Iterable[str]) -> None:
        """A CreateContainer answer set these fields (``rdt_class``, ``unified.memory.high``...)."""
        children = self._adjusted_children
        for field in fields:
            child = children.get(field)
            if child is None:
                child = children[field] = self._nri_adjusted.labels(field)
            child.inc()

    def qos_level_refused(self, source: str) -> None:
        """A pod's level claim from ``source`` (a ``[qos] sources`` name) was refused."""
        self._levels_refused.labels(source).inc()

    def nri_connection(self, state: str, since_unix: float) -> None:
        """The runtime connection entered ``state`` (one of :data:`CONNECTION_STATES`)."""
        if state not in CONNECTION_STATES:
            raise ValueError(f"unknown connection state {state!r}")
        for name in CONNECTION_STATES:
            self._nri_state.labels(name).set(1 if name == state else 0)
        self._nri_state_since.set(since_unix)

    def nri_reconnected(self) -> None:
        self._nri_reconnects.inc()

    def nri_runtime(self, name: str, version: str, nri_version: str) -> None:
        """What the runtime said in Configure (bounded by the caller)."""
        self._nri_runtime.info({"runtime": name, "version": version, "nri_version": nri_version})

    # -- reconciler ------------------------------------------------------------------------------

    def loop_cycle(self, loop: str, seconds: float, *, failed: bool) -> None:
        """One reconciler cycle of ``loop`` ended after ``seconds`` (``failed``: it raised)."""
        self._cycle_duration.labels(loop).observe(seconds)
        if failed:
            self._cycle_failures.labels(loop).inc()

    def host_write(self, path: str, outcome: str, count: int = 1) -> None:
        """``count`` writes to the system file ``path`` (task ids: one write each); counted by
        file name (``memory.high``, ``oom_score_adj``, ``tasks``, ``schemata``), never by the
        full path."""
        self._writes.labels(posixpath.basename(path), outcome).inc(count)

    # -- memory ----------------------------------------------------------------------------------

    def memory_guard(self, cap_bytes: int, usage_bytes: int) -> None:
        """The guard's cap on the reclaimed tier and the tier's usage, after a cycle."""
        self._guard_cap.value = cap_bytes
        self._tier_usage.set(usage_bytes)

    # -- configuration ---------------------------------------------------------------------------

    def config_reload(self, ok: bool, unix_time: float) -> None:
        """A configuration load took effect (``ok``) or was refused."""
        self._reloads.labels("success" if ok else "failure").inc()
        if ok:
            self._reload_success.set(unix_time)

    def ladder_level(self, level: int) -> None:
        """The mitigation ladder acts on ``level`` now (0: none, no rung engaged)."""
        self._ladder_level.set(level)

    def drop_cache(self, result: str, freed_bytes: int) -> None:
        """One drop-cache action ended with ``result`` (a fixed word such as ``done``,
        ``timeout``, ``failed``) after freeing ``freed_bytes``."""
        self._drop_cache_runs.labels(result).inc()
        if freed_bytes > 0:
            self._drop_cache_freed.inc(freed_bytes)

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

    # -- sources read at scrape time -------------------------------------------------------------

    def watch_node(self, counts: Callable[[], tuple[int, int]]) -> None:
        """``counts()`` -> (pods, containers) the agent knows on this node."""
        pods = Gauge(f"{PREFIX}_pods", "Pods the agent knows on this node.",
                     registry=self.registry)
        containers = Gauge(f"{PREFIX}_containers", "Containers the agent knows on this node.",
                           registry=self.registry)
        pods.set_function(lambda: float(counts()[0]))
        containers.set_function(lambda: float(counts()[1]))

    def watch_rejections(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """``counts()`` -> refusals on the NRI connection so far, per kind (a fixed set of short
        names such as ``oversized_frame``, never text from the peer; every kind present)."""
        self.registry.register(_RejectionCollector(counts))

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


class _RejectionCollector(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            f"{PREFIX}_nri_wire_rejections",
            "Frames or messages from the runtime refused on the NRI connection, per kind.",
            labels=["reason"])
        for reason, count in self._counts().items():
            family.add_metric([reason], count)
        yield family


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
