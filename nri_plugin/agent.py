"""Assembling the agent: every component built once, from the configuration and the probed host.

:func:`build_agent` is where dependencies are wired: the metrics, the node state, the readings
board, the resctrl filesystem, the capabilities, the NRI stub and the background services (the
config watcher, the reconciler with its pod watch, interference detection, the mitigation ladder,
the eviction manager, the metrics endpoint and the status socket), each handed exactly what it
needs. The board and the Kubernetes client are made here, once: detection publishes on the board,
the ladder, the eviction manager's in-tree plugins, the metrics and the status read it.
Started before kubelet with the cgroup driver to detect, the parts acting on cgroups are made
once kubelet's pods cgroup is there (:func:`_after_kubelet`).
:func:`run_agent` runs them all in one :class:`asyncio.TaskGroup` until stop. The daemon
(``nri-qos run``) and the simulation (``nri-qos simulate``) are two callers, with a real host and
a simulated one.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from common.aio import Backoff, sleep_until, unless_stopped
from common.audit import AuditLog
from common.metrics import Metrics, PluginMetrics
from common.state import NodeState, report_refusals
from hooks.resctrl_groups import plan_class_groups
from nri_plugin.capabilities import build_capabilities
from nri_plugin.capabilities.resctrl import SWITCHED_OFF
from nri_plugin.config.loader import ConfigError
from nri_plugin.config.schema import OBSERVE, Config
from nri_plugin.config.store import ConfigStore
from nri_plugin.obs.logs import LoggingSetup
from nri_plugin.report.metrics_server import MetricsEndpoint
from nri_plugin.report.status import StatusServer, StatusSources, ladder_sections, status_document
from nri_plugin.session.capability import Capability
from nri_plugin.session.stub import PluginIdentity, PluginStub
from nri_plugin.version import agent_version
from reconciler.detection.service import Detection
from reconciler.detection.signals import Board, Level
from reconciler.eviction.builtin import IN_TREE_CONDITIONS, in_tree_plugins
from reconciler.eviction.conditions import NodeConditions
from reconciler.eviction.manager import EvictionManager
from reconciler.host.cgroups import CgroupLayout, kubelet_driver
from reconciler.host.probe import HostInfo, probe_host
from reconciler.host.resctrl_mon import read_usage
from reconciler.host.resctrlfs import ResctrlFs
from reconciler.host.statefile import StateFile, boot_id, state_file
from reconciler.host.sysfs import SysFs
from reconciler.host.watermarks import Watermarks
from reconciler.kube import Api, KubeActions, PodWatcher, build_api_client, node_name
from reconciler.loops.base import LoopTracker
from reconciler.loops.common import ManagedCache
from reconciler.loops.kubelet_notes import noted as kubelets_noted
from reconciler.loops.memory_squeeze import GuardSqueeze
from reconciler.metrics import ReconcilerMetrics
from reconciler.mitigation.actions import CONDITION_NOTES, TAINT_NOTES, Cause, TaintAction
from reconciler.mitigation.service import (
    UNCONFIRMED,
    Mitigation,
    build_mitigation,
    counting_on,
)
from reconciler.runner import build_loops, restore_host, run_reconciler

CAPABILITY_THREADS = 4
"""Worker threads running capabilities that may block; more than one so one stuck past its
deadline does not hold up the next event."""
KUBELET_CGROUP_POLL_S = 1.0
"""How often an agent started before kubelet looks for kubelet's pods cgroup."""
LEFTOVERS_STOP_WAIT_S = 2.0
"""How long a stop waits for the taint or condition release under way (its notes stay)."""
KUBELET_CGROUPS = ("kubepods.slice", "kubepods")
"""kubelet's pods cgroup under the systemd and the cgroupfs driver."""
RECONCILER_FIELDS = frozenset({"oom_score_adj", "unified", "memory_limit", "memory_reservation",
                               "rdt_class"})
"""Settings the loops apply to running containers: drift (memcg values, oom_score_adj) and the
task-id loop (the resctrl group)."""

log = structlog.get_logger("nri_qos.daemon")

Service = Callable[[asyncio.Event], Coroutine[Any, Any, None]]
"""A long-running part of the agent; it returns once the stop event is set."""
Connection = Callable[[PluginStub, asyncio.Event], Coroutine[Any, Any, bool]]
"""How the stub reaches the runtime (:mod:`nri_plugin.connection`); False when it never could."""


@dataclass(frozen=True, slots=True)
class Agent:
    store: ConfigStore
    audit: AuditLog
    host: HostInfo
    state: NodeState
    stub: PluginStub
    services: tuple[Service, ...]
    executor: ThreadPoolExecutor
    # Settings fields the background loops apply to running containers.
    reconciler_fields: frozenset[str]
    metrics: Metrics
    # The latest detector readings (detection publishes, the rest read; empty while detection
    # does not run).
    board: Board
    tracker: LoopTracker
    endpoint: MetricsEndpoint | None
    status: StatusServer | None
    # The one place that evicts pods; None when the background half does not run.
    evictor: EvictionManager | None = None
    # The mitigation ladder, when the background services run.
    mitigation: Mitigation | None = None
    # Where the event loop's writes of the state file run (its fsync can take seconds).
    state_writer: ThreadPoolExecutor | None = None


def probe(cfg: Config, audit: AuditLog) -> tuple[HostInfo, SysFs]:
    """Probe this host once, through the sysfs layer rooted at ``reconciler.root``."""
    sysfs = SysFs(cfg.reconciler.root, audit, retries=cfg.reconciler.write_retries)
    host = probe_host(
        sysfs, cgroup_version=cfg.memory.cgroup_version, cgroup_driver=cfg.reconciler.cgroup_driver,
        resctrl_mount=cfg.resctrl.root if cfg.resctrl.enabled else None,
        amd_mb_max=cfg.resctrl.amd_mb_max,
        numa_tolerance_percent=cfg.memory_guard.numa_view_tolerance_percent,
    )
    for warning in host.warnings:
        log.warning("host_probe", warning=warning)
    return host, sysfs


def _resctrl(store: ConfigStore, host: HostInfo, sysfs: SysFs, audit: AuditLog,
             notes: StateFile | None) -> ResctrlFs | None:
    """The resctrl filesystem when usable, its class groups set up now and on every reload.
    ``notes``: the agent's state file (None for a simulation, which leaves the node as it is):
    the prefix the groups are made with is noted, and the groups of one noted by an earlier run
    go."""
    cfg = store.current
    if not cfg.resctrl.enabled:
        return None
    if host.resctrl is None:
        log.warning("resctrl_unavailable", reason=f"resctrl disabled: {host.resctrl_problem}")
        return None
    fs = ResctrlFs(sysfs, cfg.resctrl.root, host.resctrl, prefix=cfg.resctrl.group_prefix,
                   audit=audit)

    def warn(message: str) -> None:
        log.warning("resctrl_unavailable", reason=message)

    if notes is not None:
        _remove_old_groups(fs, notes)
        fs.note_prefix(notes)

    def setup(new: Config) -> None:
        # Switched off, every group goes: the resctrl capability removes them on the reload.
        if new.resctrl.enabled:
            fs.apply_class_groups(plan_class_groups(new.resctrl, fs.info, fs.our_groups()),
                                  reason="config", warn=warn)

    setup(cfg)
    store.subscribe(lambda old, new: setup(new))
    return fs


def _remove_old_groups(fs: ResctrlFs, notes: StateFile) -> None:
    """The groups made with a prefix other than the one in force go (``resctrl.group_prefix``
    changed since an earlier run); one the kernel will not remove yet stays, with its note, for
    the next start or ``nri-qos reset``."""
    for group, problem in fs.remove_old_groups(notes, "resctrl.group_prefix changed").items():
        log.warning("resctrl_group_not_removed", group=group, error=problem)


def _remove_resctrl_groups(cfg: Config, sysfs: SysFs, audit: AuditLog,
                           notes: StateFile) -> None:
    """resctrl switched off before this start: the groups an earlier run made go, as at a
    reload that switches it off (their tasks go back to the root group). Without resctrl
    mounted (and usable) at ``resctrl.root`` there is nothing of ours: nothing is said."""
    fs = ResctrlFs.detect(sysfs, cfg.resctrl.root, prefix=cfg.resctrl.group_prefix, audit=audit,
                          amd_mb_max=cfg.resctrl.amd_mb_max, warn=lambda problem: None)
    if fs is None:
        return
    # One the kernel will not remove yet stays: no task-id loop runs to try it again, the next
    # start or ``nri-qos reset`` does.
    for group, problem in fs.remove_our_groups(reason=SWITCHED_OFF).items():
        log.warning("resctrl_group_not_removed", group=group, error=problem)
    _remove_old_groups(fs, notes)
    fs.forget_prefixes(notes, own=True)


def load_store(config_path: str | None, logging_setup: LoggingSetup) -> ConfigStore | None:
    """The configuration at ``config_path`` (embedded defaults without one), with logging set
    up from it; None, after logging every error, when it is invalid."""
    store = ConfigStore(logging_setup.audit)
    try:
        store.load_initial(config_path)
    except ConfigError as exc:
        log.error("config_invalid", source=config_path, errors=exc.lines(),
                  hint="check the file with: nri-qos check-config PATH")
        return None
    logging_setup.apply(store.current.logging)
    store.subscribe(lambda old, new: logging_setup.apply(new.logging))
    store.on_load(lambda took_effect: logging_setup.retry_file() if took_effect else None)
    return store


def build_agent(store: ConfigStore, audit: AuditLog, host: HostInfo, sysfs: SysFs,
                identity: PluginIdentity, *, run_background: bool,
                metrics_address: str | None = None) -> Agent:
    """Every component of the agent. ``run_background``: run the reconciler (with the pod
    watch) when the configuration enables it, and take off the node what an earlier run left
    that the configuration no longer wants; off for a simulation, whose pods are not on this
    host (its answers still say what the reconciler would apply) and which leaves the node as
    it is. ``metrics_address`` overrides ``[metrics] address``."""
    cfg = store.current
    metrics = Metrics(agent_version())
    # One registry, one endpoint: each side defines its own series in it.
    plugin_metrics = PluginMetrics(metrics.registry)
    reconciler_metrics = ReconcilerMetrics(metrics.registry)
    # The configuration in force was loaded before there were metrics to count it.
    metrics.config_reload(True, time.time())
    store.on_load(lambda ok: metrics.config_reload(ok, time.time()))
    sysfs = sysfs.metered(metrics).observing(lambda: store.current.agent.mode == OBSERVE)
    # What the agent changed and must restore, kept across runs; a simulation touches none.
    # One thread writes for the event loop, in the order asked.
    state_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nri-qos-state")
    notes = state_file(cfg.reconciler.state_dir, writer=state_writer,
                       boot=boot_id(sysfs)) if run_background else None
    state = NodeState(qos=lambda: store.current.qos, on_refused=report_refusals(audit, metrics),
                      earlier=None if notes is None else kubelets_noted(notes))
    audit.identify(functools.partial(_pod_identity, state))
    board = Board()
    tracker = LoopTracker(reconciler_metrics)
    resctrl = _resctrl(store, host, sysfs, audit, notes)
    if notes is not None and not cfg.resctrl.enabled:
        _remove_resctrl_groups(cfg, sysfs, audit, notes)
    capabilities = build_capabilities(cfg, resctrl=resctrl, state=state, audit=audit,
                                      cgroup_v2=host.cgroup.v2,
                                      memory_total=host.memory_total_bytes)
    reconcile = cfg.reconciler.enabled
    if not reconcile:
        log.info("reconciler_disabled", reason="reconciler.enabled is false")
    store.subscribe(_reconfigurer(capabilities))
    executor = ThreadPoolExecutor(max_workers=CAPABILITY_THREADS,
                                  thread_name_prefix="nri-qos-capability")
    reconciler_fields = RECONCILER_FIELDS if reconcile else frozenset()
    stub = PluginStub(identity=identity, config=lambda: store.current, capabilities=capabilities,
                      audit=audit, executor=executor, state=state, track_containers=reconcile,
                      reconciler_fields=reconciler_fields, cgroup_v2=host.cgroup.v2,
                      metrics=plugin_metrics)
    metrics.watch_node(lambda: _counts(state))
    reconciler_metrics.watch_board(board, lambda: _pod_names(state))
    plugin_metrics.watch_rejections(stub.rejections.as_dict)
    if resctrl is not None:
        reconciler_metrics.watch_resctrl(lambda: read_usage(resctrl), lambda: _pod_names(state))
    services: list[Service] = [store.watch]
    background = reconcile and run_background
    evictor = None
    mitigation = None
    # None: the Kubernetes API is not used (no background half); False: it is not reachable
    # from here (no credentials), the agent runs without it.
    kubernetes: bool | None = None
    # The ladder's and the eviction manager's status sections, once they are made.
    sections: dict[str, Callable[[], Any]] = {}
    # The host the status reports: probed again once kubelet's pods cgroup is there.
    probed = [host]
    if background:
        assert notes is not None  # the background half runs only for a real agent
        api = build_api_client(cfg.kubernetes)
        kubernetes = api is not None
        start = functools.partial(_cgroup_services, store, state, sysfs, audit, board,
                                  reconciler_metrics, tracker, resctrl, notes, api)
        if host.cgroup.awaiting_kubelet:
            services.append(_after_kubelet(store, audit, sysfs, start, sections, probed))
        else:
            evictor, mitigation, started = start(host)
            services.extend(started)
            sections.update(ladder_sections(mitigation, evictor))
    elif notes is not None:
        # The reconciler is off: what an earlier run of it left on the node goes now.
        services.append(_leftovers(store, sysfs, audit, notes, host.cgroup))
    # Endpoints only for a real agent: a simulation must not take the node agent's port or
    # socket.
    endpoint = status = None
    if run_background and cfg.metrics.enabled:
        endpoint = MetricsEndpoint(metrics.registry, metrics_address or cfg.metrics.address,
                                   cfg.metrics.port,
                                   ready=lambda: stub.connection_state == "synchronized")
        services.append(endpoint.serve)
    if run_background and cfg.status.enabled:
        sources = StatusSources(
            stub=stub, state=state, tracker=tracker, board=board, config=lambda: store.in_force,
            config_source=lambda: store.source, host=lambda: probed[0],
            kubernetes=kubernetes, reconciler_running=background,
            wall_clock=time.time, started_unix=time.time(), sections=sections,
            restart_needed=lambda: store.restart_needed, config_refused=lambda: store.refused)
        status = StatusServer(cfg.status.socket, lambda: status_document(sources))
        services.append(status.serve)
    log.info("starting", plugin=f"{identity.index}-{identity.name}",
             capabilities=[c.name for c in capabilities], config=store.source,
             cgroup=f"v{host.cgroup.version}/" + (
                 "awaiting kubelet" if host.cgroup.awaiting_kubelet else host.cgroup.driver),
             memory_total_bytes=host.memory_total_bytes,
             reconciler=reconcile and run_background)
    return Agent(store, audit, host, state, stub, tuple(services), executor, reconciler_fields,
                 metrics, board, tracker, endpoint, status, evictor, mitigation, state_writer)


def _cgroup_services(store: ConfigStore, state: NodeState, sysfs: SysFs, audit: AuditLog,
                     board: Board, reconciler_metrics: ReconcilerMetrics, tracker: LoopTracker,
                     resctrl: ResctrlFs | None, notes: StateFile, api: Api | None,
                     host: HostInfo) -> tuple[EvictionManager, Mitigation, list[Service]]:
    """The parts that act on cgroup paths of ``host``'s layout: the reconciler (with the pod
    watch), detection, the eviction manager and the mitigation ladder."""
    cfg = store.current
    node = node_name(cfg.kubernetes)
    kube = KubeActions(api, cfg.kubernetes, audit)
    squeeze = GuardSqueeze()
    # One parse of the node state's containers for the loops, detection and the actions.
    managed = ManagedCache()
    # One reading of the zones' watermarks, aged, for detection and the loops alike.
    watermarks = Watermarks(sysfs)
    # Which readings count for the ladder, its eviction plugins and detection's pace.
    counting = counting_on(lambda: store.in_force, host)
    # The actions read the configuration in force: observe mode holds them in dry-run.
    evictor = EvictionManager(
        lambda: store.in_force, state, kube, node, audit, sysfs, host.cgroup,
        in_tree_plugins(board, lambda: store.in_force.eviction, counting),
        metrics=reconciler_metrics, changes=board.subscribe, notes=notes)
    mitigation = build_mitigation(lambda: store.in_force, board, state, sysfs, host, audit,
                                  kube=kube, node=node,
                                  squeeze=squeeze, evictor=evictor, managed=managed,
                                  metrics=reconciler_metrics, notes=notes)
    return evictor, mitigation, [
        _reconciler(store, state, sysfs, host, resctrl, audit, api, node, squeeze,
                    reconciler_metrics, tracker, managed, notes, mitigation.engaged,
                    watermarks),
        Detection(lambda: store.current, board, state, sysfs, host, audit, managed=managed,
                  watermarks=watermarks, counting=counting).run,
        evictor.run, mitigation.run]


def _after_kubelet(store: ConfigStore, audit: AuditLog, sysfs: SysFs,
                   start: Callable[[HostInfo], tuple[EvictionManager, Mitigation,
                                                     list[Service]]],
                   sections: dict[str, Callable[[], Any]], probed: list[HostInfo]) -> Service:
    """With ``cgroup_driver = "auto"``, an agent started before kubelet (a node booting) cannot
    tell the driver: kubelet has made neither ``kubepods.slice`` nor ``kubepods``. A guess
    would point every loop, detector and the guard at cgroups that are not kubelet's. The NRI
    side does not need the layout and serves meanwhile; the parts that do are made once the
    pods cgroup is there (looked for every :data:`KUBELET_CGROUP_POLL_S`), from the host
    probed again then, and run until stop."""
    async def run(stop: asyncio.Event) -> None:
        host = probed[0]
        log.warning("waiting_for_kubelet_cgroup", cgroups=list(KUBELET_CGROUPS),
                    hint="cgroup_driver is auto and kubelet has not made its pods cgroup yet: "
                         "the reconciler, detection, the ladder and eviction start once it is "
                         "there (or set [reconciler] cgroup_driver)")
        while host.cgroup.awaiting_kubelet:
            if await sleep_until(KUBELET_CGROUP_POLL_S, stop):
                return
            if kubelet_driver(sysfs, host.cgroup.version) is not None:
                host, _ = await asyncio.to_thread(probe, store.current, audit)
        evictor, mitigation, services = start(host)
        probed[0] = host
        sections.update(ladder_sections(mitigation, evictor))
        log.info("kubelet_cgroup_found", cgroup=f"v{host.cgroup.version}/{host.cgroup.driver}")
        async with asyncio.TaskGroup() as group:
            for service in services:
                group.create_task(service(stop))

    return run


def _pod_identity(state: NodeState, fields: Mapping[str, Any]) -> Mapping[str, str]:
    pod = fields.get("pod")
    found = state.pod_identity(uid=str(fields.get("pod_uid", "")),
                               ref=pod if isinstance(pod, str) else "")
    if found is None:
        return {}
    uid, namespace, name = found
    return {"pod_uid": uid, "pod_namespace": namespace, "pod_name": name}


def _pod_names(state: NodeState) -> Mapping[str, tuple[str, str]]:
    return {view.info.uid: (view.info.namespace, view.info.name)
            for view in state.snapshot().pods.values()}


def _counts(state: NodeState) -> tuple[int, int]:
    snapshot = state.snapshot()
    return len(snapshot.pods), len(snapshot.containers)


def _reconfigurer(capabilities: list[Capability]) -> Callable[[Config, Config], None]:
    def reconfigure(old: Config, new: Config) -> None:
        for capability in capabilities:
            # One failing must not leave the ones after it on the old configuration while the
            # loops run the new one.
            try:
                capability.reconfigure(new)
            except Exception:
                log.exception("capability_reconfigure_failed", capability=capability.name)

    return reconfigure


def _reconciler(store: ConfigStore, state: NodeState, sysfs: SysFs, host: HostInfo,
                resctrl: ResctrlFs | None, audit: AuditLog, api: Api | None, node: str,
                squeeze: GuardSqueeze, metrics: ReconcilerMetrics, tracker: LoopTracker,
                managed: ManagedCache, notes: StateFile,
                ladder_engaged: Callable[[], bool], watermarks: Watermarks) -> Service:
    async def run(stop: asyncio.Event) -> None:
        cfg = store.current
        watcher = None if api is None else PodWatcher(api, cfg.kubernetes, node)
        loops = build_loops(lambda: store.current, state, sysfs, host, resctrl, audit, squeeze,
                            metrics, managed=managed, notes=notes,
                            ladder_engaged=ladder_engaged, watermarks=watermarks)
        await run_reconciler(loops, state, stop, watcher,
                             read_keys=lambda: store.current.read_keys(),
                             backoff_max=lambda: store.current.reconciler.backoff_max_s,
                             tracker=tracker,
                             config_changes=lambda call: store.subscribe(
                                 lambda old, new: call()))

    return run


def _leftovers(store: ConfigStore, sysfs: SysFs, audit: AuditLog, notes: StateFile,
               layout: CgroupLayout) -> Service:
    """Once at start: restores what the state file says an earlier run changed (host files,
    then, when the API is reachable, its taint and condition, and the eviction conditions its
    eviction manager may have left, the in-tree ones and those noted in the state file, as that
    manager does at a start with it off). What the API refuses is tried again
    (``mitigation.retry_initial_s``, doubling to ``retry_max_s``) until it is done or the agent
    stops, as the ladder retries a release: a taint left behind would keep new pods off the node
    for good. ``notes``: the agent's state file, the one object that writes it."""
    async def release(stop: asyncio.Event) -> None:
        cfg = store.current
        reason = "reconciler switched off"
        await asyncio.to_thread(restore_host, sysfs, notes, reason, layout)
        noted = bool(notes.entries(TAINT_NOTES) or notes.entries(CONDITION_NOTES))
        api = build_api_client(cfg.kubernetes)
        if api is None:
            if noted:
                log.warning("leftovers_kept", reason="no Kubernetes API access: the taint an "
                            "earlier run placed stays (nri-qos reset takes it off)")
            return
        kube = KubeActions(api, cfg.kubernetes, audit)
        node = node_name(cfg.kubernetes)
        taint = TaintAction(lambda: store.current, kube, node, audit, notes=notes)
        # No eviction manager runs to keep them true: they go as an uninstall leaves the node.
        conditions = NodeConditions(kube, node, audit, lambda plugin, eviction: False, notes)
        clock = asyncio.get_running_loop().time
        withdrawn = False
        backoff: Backoff | None = None
        while not stop.is_set():
            if noted:
                released = await taint.release(Cause(Level.NONE, None, reason), dry_run=False)
                noted = released.result in UNCONFIRMED
            if not withdrawn:
                withdrawn = await conditions.withdraw(IN_TREE_CONDITIONS,
                                                      store.current.eviction, clock())
            if not noted and withdrawn:
                return
            retry = store.current.mitigation
            backoff = backoff or Backoff(retry.retry_initial_s, retry.retry_max_s)
            await sleep_until(backoff.next(), stop)

    # A stop waits a little for a release under way, not for an API server holding it up.
    return lambda stop: unless_stopped(release(stop), stop, LEFTOVERS_STOP_WAIT_S)


async def run_agent(agent: Agent, connection: Connection, stop: asyncio.Event) -> int:
    """Run the connection and every service in one TaskGroup until ``stop`` is set; the exit
    status (1 when the connection could never be used)."""
    # What exists by now (modules, the Kubernetes client, config, capabilities) lives as long
    # as the process. Out of the collector's generations, it is never scanned again: a full
    # collection would otherwise walk it all (some 30 ms), in the middle of whichever
    # CreateContainer triggered it. Garbage is collected first so that none of it is kept.
    gc.collect()
    gc.freeze()
    try:
        async with asyncio.TaskGroup() as group:
            connected = group.create_task(connection(agent.stub, stop))
            for service in agent.services:
                group.create_task(service(stop))
    finally:
        gc.unfreeze()
        agent.executor.shutdown(wait=False, cancel_futures=True)
        if agent.state_writer is not None:
            # Writes still queued are awaited by their callers (bounded), so none is cut.
            agent.state_writer.shutdown(wait=False)
        log.info("stopped")
    return 0 if connected.result() else 1
