"""The agent's metrics registry, the series both the NRI plugin and the reconciler record, and
the NRI plugin's own (``nri_*``).

:class:`Metrics` owns a :class:`~prometheus_client.CollectorRegistry` (never the library's global
default registry: tests and two agents in one process stay apart): the composition root creates
one and hands :attr:`Metrics.registry` to :class:`PluginMetrics` and to the reconciler's
:class:`~reconciler.metrics.ReconcilerMetrics`, which define their series in it. Each series is
defined once, with its unit in the name and a fixed, small label set; the HTTP endpoint
(:mod:`nri_plugin.report.metrics_server`) only renders the registry.

Two ways in:

* **recorded**: the code that does the work calls a method (``nri_request``, ``host_write`` ...).
  Hot-path methods keep the labelled children they resolved once, so a call costs a dict lookup
  and the increments;
* **collected at scrape time**: sources registered with ``watch_*`` are read when the endpoint is
  scraped (the node's pod counts, the wire's refusals). The endpoint renders in a worker thread,
  so a source may read files.

Label values are bounded: events, results, file names, fields and refusal kinds come from fixed
sets in the code. This module imports nothing of the project, so any layer may record into it.
"""

from __future__ import annotations

import platform
import posixpath
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

PREFIX = "nri_qos"

NRI_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 1.0, 2.5)
"""Seconds; 0.1-5 ms resolved finely (where answers are), then up to the runtime's 2 s timeout."""

NRI_RESULTS = ("ok", "fail-open", "error")
"""How an NRI request was answered: everything applied; answered with what worked (a capability
failed or missed its deadline, or the input was unusable); an error status."""
CONNECTION_STATES = ("disconnected", "connected", "synchronized")
"""The runtime connection: no socket; registered and being configured or synchronized; serving
events."""


def new_registry() -> CollectorRegistry:
    """An empty registry of the agent's own."""
    # A counter's ``_created`` series doubles every counter for a value nobody queries.
    disable_created_metrics()  # type: ignore[no-untyped-call]  # the library's own stub
    return CollectorRegistry()


class Metrics:
    """The registry, and the series of what both sides do: the process, the build, configuration
    loads, QoS level refusals, writes to host files, the node's pods; safe from any thread."""

    def __init__(self, version: str = "unknown") -> None:
        self.registry = new_registry()
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
        # Refused loads are counted, but a counter cannot say whether the files as they are now
        # are in force: the agent tries them once per change, so it may never count again.
        self._refused = Gauge(
            f"{PREFIX}_config_refused",
            "1 while the configuration files' latest version was refused and an older one is "
            "in force, 0 once a load takes effect.", registry=r)
        self._levels_refused = Counter(
            f"{PREFIX}_qos_level_refused_total",
            "QoS level claims refused (above the pod's class, namespace or level at creation), "
            "per source.", ["source"], registry=r)
        self._writes = Counter(
            f"{PREFIX}_host_writes_total",
            "Writes to cgroup, procfs and resctrl files, per file name and outcome (written, "
            "unchanged, gone, failed, timeout, observed).", ["file", "outcome"], registry=r)

    def config_reload(self, ok: bool, unix_time: float) -> None:
        """A configuration load took effect (``ok``) or was refused."""
        self._reloads.labels("success" if ok else "failure").inc()
        self._refused.set(0 if ok else 1)
        if ok:
            self._reload_success.set(unix_time)

    def qos_level_refused(self, source: str) -> None:
        """A pod's level claim from ``source`` (a ``[qos] sources`` name) was refused."""
        self._levels_refused.labels(source).inc()

    def host_write(self, path: str, outcome: str, count: int = 1) -> None:
        """``count`` writes to the system file ``path`` (task ids: one write each); counted by
        file name (``memory.high``, ``oom_score_adj``, ``tasks``, ``schemata``), never by the
        full path."""
        self._writes.labels(posixpath.basename(path), outcome).inc(count)

    def watch_node(self, counts: Callable[[], tuple[int, int]]) -> None:
        """``counts()`` -> (pods, containers) the agent knows on this node."""
        pods = Gauge(f"{PREFIX}_pods", "Pods the agent knows on this node.",
                     registry=self.registry)
        containers = Gauge(f"{PREFIX}_containers", "Containers the agent knows on this node.",
                           registry=self.registry)
        pods.set_function(lambda: float(counts()[0]))
        containers.set_function(lambda: float(counts()[1]))


class PluginMetrics:
    """The NRI plugin's series (``nri_*``): requests, answers, the runtime connection and the
    wire's refusals; in ``registry`` (a fresh one when None); safe from any thread."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
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

    def watch_rejections(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """``counts()`` -> refusals on the NRI connection so far, per kind (a fixed set of short
        names such as ``oversized_frame``, never text from the peer; every kind present)."""
        self.registry.register(_RejectionCollector(counts))


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
