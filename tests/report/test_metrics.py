"""Metrics: the agent's own registry, each series recorded where the work happens, the endpoint.

The end-to-end test runs the agent as ``nri-qos run`` assembles it, on a fake host tree, against
the runtime simulator over a real socket, and scrapes the endpoint over HTTP before and after a
pod lifecycle and reconcile cycles: every series must exist and move.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gzip
import logging
import platform
import socket
from collections.abc import Callable
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

import nri_plugin.report.metrics_server
from common.aio import Backoff
from common.audit import AuditLog, MemoryAuditSink
from common.metrics import Metrics, PluginMetrics
from hooks.events import Event
from nri_plugin.agent import build_agent, load_store, probe, run_agent
from nri_plugin.config.store import ConfigStore
from nri_plugin.connection import run_external
from nri_plugin.obs.logs import LoggingSetup
from nri_plugin.report.metrics_server import MAX_CONNECTIONS, REQUEST_TIMEOUT_S, MetricsEndpoint
from nri_plugin.session.stub import PluginIdentity
from nri_plugin.sim.simulator import RuntimeSimulator
from nri_plugin.version import agent_version
from nri_plugin.wire.nri_api import PLUGIN_SERVICE
from reconciler.detection.signals import NODE, Board, Level, Reading, pod_scope
from reconciler.host.resctrl_mon import read_usage
from reconciler.host.resctrlfs import ResctrlFs, read_info
from reconciler.host.sysfs import SysFs
from reconciler.metrics import ReconcilerMetrics
from tests.support.builders import LEVEL
from tests.support.fakesys import GIB, FakeHost, nri_messages, write
from tests.support.resctrl_trees import intel_tree

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

UID_A = "0a0a0a0a-1111-2222-3333-444444444444"
UID_B = "0b0b0b0b-1111-2222-3333-444444444444"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def http_get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


async def until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - state written by worker threads
            await asyncio.sleep(0.02)


def mon_data(group_dir: Path, domain: str, llc: str, total: str, local: str) -> None:
    base = group_dir / "mon_data" / f"mon_L3_{domain}"
    write(base / "llc_occupancy", llc)
    write(base / "mbm_total_bytes", total)
    write(base / "mbm_local_bytes", local)


async def test_every_series_exists_and_moves(tmp_path: Path) -> None:
    root = tmp_path / "host"
    host = FakeHost(root)
    resctrl = host.make_resctrl()
    host.set_numa([(8 * GIB, 32 * GIB, 1000), (8 * GIB, 32 * GIB, 1000)])
    host.set_tier_usage("besteffort", 1 * GIB, per_node=[GIB // 2, GIB // 2])
    existing = host.add_pod(UID_A, tier="besteffort", annotations={LEVEL: "reclaimed_cores"})
    created = host.add_pod(UID_B, tier="besteffort", annotations={LEVEL: "reclaimed_cores"})
    # Monitoring counters the kernel would keep for our class group and a pod group.
    mon_data(resctrl / "nriqos-reclaimed_cores", "00", "1048576\n", "5000\n", "4000\n")
    mon_data(resctrl / "nriqos-reclaimed_cores", "01", "Unavailable\n", "7000\n", "6000\n")
    mon_data(resctrl / f"nriqos-pod-{UID_A}", "00", "2048\n", "300\n", "200\n")
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(
        '[agent]\nmode = "enforce"\n'
        f'[reconciler]\nroot = "{root}"\nstate_dir = "{tmp_path / "state"}"\n'
        'resctrl_interval_s = 0.1\ndrift_interval_s = 0.1\n'
        "[memory_guard]\ninterval_s = 0.1\n[numa]\ninterval_s = 0.1\n"
        "[kubernetes]\nenabled = false\n[status]\nenabled = false\n"
        f'[metrics]\nenabled = true\naddress = "127.0.0.1"\nport = {port}\n')
    pod_a, containers_a = nri_messages(existing)
    socket_path = tmp_path / "nri.sock"
    simulator = RuntimeSimulator(socket_path, pods=[pod_a], containers=containers_a)
    await simulator.start()
    logging_setup = LoggingSetup(level="warning")
    store = load_store(str(config), logging_setup)
    assert store is not None
    found, sysfs = probe(store.current, logging_setup.audit)
    agent = build_agent(store, logging_setup.audit, found, sysfs, PluginIdentity("nri-qos", "10"),
                        run_background=True)
    stop = asyncio.Event()
    connection = functools.partial(run_external, socket_path=str(socket_path),
                                   backoff=Backoff(0.02, 0.05))
    task = asyncio.create_task(run_agent(agent, connection, stop))
    try:
        conn = await simulator.wait_ready()
        status, _ = await http_get(port, "/readyz")
        assert status == 200
        before = parse((await http_get(port, "/metrics"))[1])
        assert value(before, "nri_qos_nri_connection_state", state="synchronized") == 1
        assert value(before, "nri_qos_nri_requests_total", event="synchronize", result="ok") == 1

        # A whole pod lifecycle through the runtime simulator.
        pod_b, containers_b = nri_messages(created)
        for event in (Event.RUN_POD_SANDBOX, Event.CREATE_CONTAINER, Event.START_CONTAINER,
                      Event.STOP_CONTAINER, Event.REMOVE_CONTAINER, Event.STOP_POD_SANDBOX,
                      Event.REMOVE_POD_SANDBOX):
            pod_event = event in (Event.RUN_POD_SANDBOX, Event.STOP_POD_SANDBOX,
                                  Event.REMOVE_POD_SANDBOX)
            await simulator.send(conn, event, pod_b, None if pod_event else containers_b[0])
        # A message that does not decode: answered (fail-open) and counted as a refusal.
        assert conn.peer is not None
        await conn.peer.call(PLUGIN_SERVICE, "CreateContainer", b"\xff\xff\xff", timeout_s=5)
        agent.board.publish("memory_free", [
            Reading("memory_free", NODE, Level.LOW, 9.0, 10.0, "percent"),
            Reading("memory_free", pod_scope(UID_A), Level.UNKNOWN, 0, 0, "percent",
                    reason="unreadable", pod_uid=UID_A),
        ])
        loops = ("resctrl_tasks", "drift", "memory_guard", "numa_binding")
        cycles = {name: agent.tracker.last()[name].cycles for name in loops}
        await until(lambda: all(agent.tracker.last()[n].cycles >= cycles[n] + 2 for n in loops))
        after = parse((await http_get(port, "/metrics"))[1])

        # NRI: per event and result, durations in the 0.1-5 ms buckets, fields, connection.
        for name in ("run_pod_sandbox", "create_container", "start_container",
                     "stop_container", "remove_container", "remove_pod_sandbox"):
            assert value(after, "nri_qos_nri_requests_total", event=name, result="ok") == 1
            # CreateContainer twice: once more with the payload that does not decode.
            assert value(after, "nri_qos_nri_request_duration_seconds_count", event=name) == (
                2 if name == "create_container" else 1)
        assert value(after, "nri_qos_nri_requests_total", event="create_container",
                     result="fail-open") == 1
        assert value(before, "nri_qos_nri_requests_total", event="create_container",
                     result="ok") == 0
        assert value(after, "nri_qos_nri_request_duration_seconds_bucket",
                     event="create_container", le="2.5") == 2
        assert ("nri_qos_nri_request_duration_seconds_bucket",
                frozenset({("event", "create_container"), ("le", "0.0001")})) in after
        for field in ("rdt_class", "oom_score_adj"):
            assert value(after, "nri_qos_nri_adjusted_fields_total", field=field) == 1
        assert value(after, "nri_qos_nri_runtime_info", runtime="containerd",
                     version=simulator.runtime.version,
                     nri_version=simulator.runtime.nri_version) == 1
        assert value(after, "nri_qos_nri_connection_state_timestamp_seconds") > 0
        # The process, the build, the configuration loaded at start.
        assert value(after, "process_resident_memory_bytes") > 0
        assert value(after, "process_open_fds") > 0
        assert ("process_cpu_seconds_total", frozenset()) in after
        assert value(after, "nri_qos_build_info", version=agent_version(),
                     python=platform.python_version()) == 1
        assert value(after, "nri_qos_config_reloads_total", result="success") == 1
        assert value(after, "nri_qos_config_reloads_total", result="failure") == 0
        assert value(after, "nri_qos_config_last_reload_success_timestamp_seconds") > 0
        # No _created series beside the counters.
        assert not [name for name in names(after) if name.endswith("_created")]
        assert value(after, "nri_qos_nri_wire_rejections_total", reason="bad_payload") == 1
        # Every kind is exported, at 0 until it happens.
        assert ("nri_qos_nri_wire_rejections_total",
                frozenset({("reason", "oversized_frame")})) in after
        # Reconciler: cycles per loop, writes by file name and outcome.
        for loop in loops:
            assert (value(after, "nri_qos_reconciler_cycle_duration_seconds_count", loop=loop)
                    > value(before, "nri_qos_reconciler_cycle_duration_seconds_count",
                            loop=loop))
        assert value(after, "nri_qos_reconciler_cycle_failures_total", loop="drift") == 0
        assert value(after, "nri_qos_host_writes_total", file="tasks", outcome="written") >= 2
        assert value(after, "nri_qos_host_writes_total", file="oom_score_adj",
                     outcome="written") >= 1
        assert (value(after, "nri_qos_host_writes_total", file="oom_score_adj",
                      outcome="unchanged")
                > value(before, "nri_qos_host_writes_total", file="oom_score_adj",
                        outcome="unchanged"))
        assert value(after, "nri_qos_host_writes_total", file="schemata", outcome="written") >= 1
        # Memory: the guard's cap and the tier's usage, detector levels from the board.
        limit = (host.tier_dir("besteffort") / "memory.limit_in_bytes").read_text()
        assert value(after, "nri_qos_memory_guard_cap_bytes") == int(limit)
        assert value(after, "nri_qos_reclaimed_tier_usage_bytes") == 1 * GIB
        # No pod: empty namespace and pod labels (absent, for Prometheus). A pod: the labels
        # kube-state-metrics puts on its series, beside its uid.
        assert value(after, "nri_qos_detector_level", detector="memory_free", scope=NODE,
                     namespace="", pod="") == 1
        pod_labels = {"namespace": existing.info.namespace, "pod": existing.info.name}
        assert value(after, "nri_qos_detector_level", detector="memory_free",
                     scope=pod_scope(UID_A), **pod_labels) == -1
        assert value(after, "nri_qos_pods") == 1
        assert value(after, "nri_qos_containers") == 1
        # resctrl monitoring per group and L3 domain; "Unavailable" is left out.
        cls = {"group": "nriqos-reclaimed_cores", "kind": "class", "namespace": "", "pod": ""}
        assert value(after, "nri_qos_resctrl_llc_occupancy_bytes", domain="00", **cls) == 1 << 20
        assert ("nri_qos_resctrl_llc_occupancy_bytes",
                frozenset({**cls, "domain": "01"}.items())) not in after
        assert value(after, "nri_qos_resctrl_mbm_total_bytes_total", domain="01", **cls) == 7000
        assert value(after, "nri_qos_resctrl_mbm_local_bytes_total", domain="00", **cls) == 4000
        assert value(after, "nri_qos_resctrl_mbm_total_bytes_total", domain="00",
                     group=f"nriqos-pod-{UID_A}", kind="pod", **pod_labels) == 300

        # The runtime restarts: a reconnect, and the state goes through disconnected.
        await simulator.stop()
        simulator = RuntimeSimulator(socket_path, pods=[pod_a], containers=containers_a)
        await simulator.start()
        await simulator.wait_ready()
        again = parse((await http_get(port, "/metrics"))[1])
        assert value(again, "nri_qos_nri_reconnects_total") == 1
        assert value(again, "nri_qos_nri_requests_total", event="synchronize", result="ok") == 2
    finally:
        stop.set()
        exit_status = await task
        await simulator.stop()
        logging_setup.close()
    assert exit_status == 0
    # Stopped with the agent: nothing listens any more.
    with pytest.raises(ConnectionRefusedError):
        await http_get(port, "/metrics")


def test_registry_is_the_agents_own() -> None:
    first, second = PluginMetrics(), PluginMetrics()
    first.nri_reconnected()
    assert first.registry.get_sample_value("nri_qos_nri_reconnects_total") == 1
    assert second.registry.get_sample_value("nri_qos_nri_reconnects_total") == 0
    assert prometheus_client.REGISTRY.get_sample_value("nri_qos_nri_reconnects_total") is None


def test_unknown_results_and_states_are_refused() -> None:
    plugin = PluginMetrics()
    with pytest.raises(ValueError, match="unknown NRI result"):
        plugin.nri_request("create_container", "partial", 0.001)
    with pytest.raises(ValueError, match="unknown connection state"):
        plugin.nri_connection("registering", 0.0)
    with pytest.raises(ValueError, match="unknown NUMA balance result"):
        ReconcilerMetrics().numa_balance_step("observed", 0, 0.0)


def test_series_of_actions_record_what_they_are_told() -> None:
    """The series the ladder, drop-cache, eviction, taint and wire code record into."""
    metrics = ReconcilerMetrics()
    get = metrics.registry.get_sample_value
    metrics.ladder_level(2)
    metrics.drop_cache("done", 3 * GIB)
    metrics.drop_cache("timeout", 0)
    metrics.eviction("memory_pressure", "evicted")
    metrics.eviction("memory_pressure", "blocked")
    metrics.taint("nri-qos.io/memory-pressure", True)
    assert get("nri_qos_mitigation_ladder_level") == 2
    assert get("nri_qos_drop_cache_runs_total", {"result": "done"}) == 1
    assert get("nri_qos_drop_cache_runs_total", {"result": "timeout"}) == 1
    assert get("nri_qos_drop_cache_freed_bytes_total") == 3 * GIB
    assert get("nri_qos_evictions_total", {"plugin": "memory_pressure", "result": "evicted"}) == 1
    assert get("nri_qos_evictions_total", {"plugin": "memory_pressure", "result": "blocked"}) == 1
    assert get("nri_qos_node_taint", {"taint": "nri-qos.io/memory-pressure"}) == 1
    metrics.taint("nri-qos.io/memory-pressure", False)
    assert get("nri_qos_node_taint", {"taint": "nri-qos.io/memory-pressure"}) == 0


def test_writes_are_counted_by_file_name_and_outcome(tmp_path: Path) -> None:
    metrics = Metrics()
    sysfs = SysFs(tmp_path, AuditLog(MemoryAuditSink())).metered(metrics)
    cg = tmp_path / "sys/fs/cgroup/memory/kubepods/pod1"
    write(cg / "memory.soft_limit_in_bytes", "0\n")
    write(cg / "tasks", "")
    path = "/sys/fs/cgroup/memory/kubepods/pod1/memory.soft_limit_in_bytes"
    sysfs.write_if_changed(path, "4096", "test")
    sysfs.write_if_changed(path, "4096", "test")
    sysfs.write_if_changed("/sys/fs/cgroup/memory/kubepods/pod2/memory.soft_limit_in_bytes",
                           "1", "test")
    (cg / "ro").mkdir()
    sysfs.write("/sys/fs/cgroup/memory/kubepods/pod1/ro", "1", "test")  # EISDIR: failed
    sysfs.append_ids("/sys/fs/cgroup/memory/kubepods/pod1/tasks", [10, 11, 12])
    get = metrics.registry.get_sample_value
    for outcome, count in (("written", 1), ("unchanged", 1), ("gone", 1)):
        assert get("nri_qos_host_writes_total",
                   {"file": "memory.soft_limit_in_bytes", "outcome": outcome}) == count
    assert get("nri_qos_host_writes_total", {"file": "ro", "outcome": "failed"}) == 1
    assert get("nri_qos_host_writes_total", {"file": "tasks", "outcome": "written"}) == 3


def test_resctrl_usage_reads_only_our_groups(tmp_path: Path) -> None:
    root = tmp_path / "root"
    mount = intel_tree(root / "sys/fs/resctrl")
    sysfs = SysFs(root)
    fs = ResctrlFs(sysfs, "/sys/fs/resctrl", read_info(sysfs, "/sys/fs/resctrl", 2048),
                   prefix="nriqos-", audit=AuditLog(MemoryAuditSink()))
    mon_data(mount / "nriqos-dedicated_cores", "00", "100\n", "Error\n", "Unavailable\n")
    mon_data(mount / "nriqos-pod-abc", "01", "Unavailable\n", "Unavailable\n", "Unavailable\n")
    mon_data(mount / "someone-else", "00", "1\n", "1\n", "1\n")
    mon_data(mount / "nriqos-unknown", "00", "1\n", "1\n", "1\n")
    write(mount / "nriqos-dedicated_cores/mon_data/stray/llc_occupancy", "5\n")
    (usage,) = read_usage(fs)
    assert (usage.group, usage.kind, usage.domain) == ("nriqos-dedicated_cores", "class", "00")
    assert (usage.llc_occupancy_bytes, usage.mbm_total_bytes, usage.mbm_local_bytes) == \
        (100, None, None)


def test_resctrl_counters_negative_or_unreadable_are_left_out(tmp_path: Path) -> None:
    root = tmp_path / "root"
    mount = intel_tree(root / "sys/fs/resctrl")
    sysfs = SysFs(root)
    fs = ResctrlFs(sysfs, "/sys/fs/resctrl", read_info(sysfs, "/sys/fs/resctrl", 2048),
                   prefix="nriqos-", audit=AuditLog(MemoryAuditSink()))
    mon_data(mount / "nriqos-dedicated_cores", "00", "-5\n", "x\n", " 7\n")
    total = mount / "nriqos-dedicated_cores/mon_data/mon_L3_00/mbm_total_bytes"
    total.unlink()
    total.mkdir()  # reading it fails (EISDIR): that counter only is lost
    (usage,) = read_usage(fs)
    assert (usage.llc_occupancy_bytes, usage.mbm_total_bytes, usage.mbm_local_bytes) == \
        (None, None, 7)


def test_no_monitoring_reads_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    mount = intel_tree(root / "sys/fs/resctrl")
    sysfs = SysFs(root)
    info = read_info(sysfs, "/sys/fs/resctrl", 2048)
    mon_data(mount / "nriqos-dedicated_cores", "00", "100\n", "1\n", "1\n")
    fs = ResctrlFs(sysfs, "/sys/fs/resctrl", dataclasses.replace(info, monitoring=False),
                   prefix="nriqos-", audit=AuditLog(MemoryAuditSink()))
    assert read_usage(fs) == []


async def test_endpoint_answers_health_and_refuses_the_rest() -> None:
    ready = [False]
    endpoint = MetricsEndpoint(Metrics().registry, "127.0.0.1", 0, ready=lambda: ready[0])
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(endpoint.serve(stop))
        await until(lambda: endpoint.bound is not None)
        assert endpoint.bound is not None
        port = endpoint.bound[1]
        assert await http_get(port, "/healthz") == (200, "ok\n")
        assert (await http_get(port, "/readyz"))[0] == 503
        ready[0] = True
        assert await http_get(port, "/readyz") == (200, "ready\n")
        assert (await http_get(port, "/metrics?x=1"))[0] == 200
        assert (await http_get(port, "/nope"))[0] == 404
        assert (await http_get(port, "/metrics", method="POST"))[0] == 405
        # Garbage and a client that never finishes its request: neither holds the endpoint.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x00\x01 garbage\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 400")
        writer.close()
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await http_get(port, "/healthz"))[0] == 200
        stopping = asyncio.get_running_loop().time()
        stop.set()
    # Stopping closed the idle connection too, at once: not when its read timed out.
    assert asyncio.get_running_loop().time() - stopping < REQUEST_TIMEOUT_S
    assert await idle_reader.read() == b""
    idle_writer.close()


async def test_a_collector_that_fails_answers_500() -> None:
    metrics = ReconcilerMetrics()

    class Broken:
        def current(self) -> list[Reading]:
            raise RuntimeError("board on fire")

    metrics.watch_board(Broken())
    endpoint = MetricsEndpoint(metrics.registry, "127.0.0.1", 0, ready=lambda: True)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(endpoint.serve(stop))
        await until(lambda: endpoint.bound is not None)
        assert endpoint.bound is not None
        with capture_logs() as logs:
            assert (await http_get(endpoint.bound[1], "/metrics"))[0] == 500
        assert any(entry["event"] == "metrics_render_failed" for entry in logs)
        stop.set()


async def test_port_in_use_is_logged_and_the_agent_goes_on() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        endpoint = MetricsEndpoint(Metrics().registry, "127.0.0.1", port, ready=lambda: True)
        stop = asyncio.Event()
        with capture_logs() as logs:
            serving = asyncio.create_task(endpoint.serve(stop))
            await until(lambda: any(e["event"] == "metrics_unavailable" for e in logs))
            assert not serving.done()
            stop.set()
            await serving
    assert endpoint.bound is None


def test_board_levels_follow_publications() -> None:
    metrics = ReconcilerMetrics()
    board = Board()
    pods = {UID_A: ("shop", "web-0")}
    metrics.watch_board(board, lambda: pods)
    board.publish("psi", [Reading("psi", NODE, Level.HIGH, 50.0, 40.0, "percent"),
                          Reading("psi", pod_scope(UID_A), Level.LOW, 5.0, 4.0, "percent",
                                  pod_uid=UID_A)])
    get = metrics.registry.get_sample_value
    node = {"detector": "psi", "scope": NODE, "namespace": "", "pod": ""}
    pod = {"detector": "psi", "scope": pod_scope(UID_A), "namespace": "shop", "pod": "web-0"}
    assert get("nri_qos_detector_level", node) == 3
    assert get("nri_qos_detector_level", pod) == 1
    # The pod goes: its names go with it, never kept for a pod the node no longer has.
    del pods[UID_A]
    assert get("nri_qos_detector_level", pod) is None
    board.publish("psi", [])
    assert get("nri_qos_detector_level", node) is None


async def request(port: int, head: str) -> tuple[int, dict[str, str], bytes]:
    """One raw request; the status, the header fields (lower-case names) and the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    top, _, body = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        name, _, text = line.partition(":")
        fields[name.strip().lower()] = text.strip()
    return int(lines[0].split()[1]), fields, body


class Serving:
    """A metrics endpoint of its own on a free port, for one test."""

    def __init__(self, metrics: Metrics) -> None:
        self.endpoint = MetricsEndpoint(metrics.registry, "127.0.0.1", 0, ready=lambda: True)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> int:
        self.task = asyncio.create_task(self.endpoint.serve(self.stop))
        await until(lambda: self.endpoint.bound is not None)
        assert self.endpoint.bound is not None
        return self.endpoint.bound[1]

    async def __aexit__(self, *_: object) -> None:
        self.stop.set()
        assert self.task is not None
        await self.task


def counted_metrics() -> Metrics:
    metrics = Metrics("9.9.9")
    PluginMetrics(metrics.registry).nri_request("create_container", "ok", 0.001)
    return metrics


async def test_scrapes_negotiate_the_format_with_the_librarys_exposition() -> None:
    async with Serving(counted_metrics()) as port:
        status, fields, body = await request(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200
        assert fields["content-type"].startswith("text/plain; version=0.0.4")
        text = body.decode()
        assert 'nri_qos_nri_requests_total{event="create_container",result="ok"} 1.0' in text
        assert "_created" not in text
        status, fields, body = await request(
            port, "GET /metrics HTTP/1.1\r\nHost: x\r\n"
                  "Accept: application/openmetrics-text; version=1.0.0\r\n\r\n")
        assert status == 200
        assert fields["content-type"].startswith("application/openmetrics-text")
        open_text = body.decode()
        assert open_text.endswith("# EOF\n")
        assert 'nri_qos_nri_requests_total{event="create_container",result="ok"} 1.0' in open_text
        assert "_created" not in open_text


async def test_gzip_when_the_scraper_accepts_it() -> None:
    async with Serving(counted_metrics()) as port:
        status, fields, body = await request(
            port, "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n")
        assert status == 200
        assert fields["content-encoding"] == "gzip"
        assert b"nri_qos_nri_requests_total" in gzip.decompress(body)
        assert int(fields["content-length"]) == len(body)


async def test_head_is_answered_without_a_body() -> None:
    async with Serving(counted_metrics()) as port:
        _, got, body = await request(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        status, fields, empty = await request(port, "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200
        assert empty == b""
        assert fields["content-type"] == got["content-type"]
        # Within a few bytes of the GET's: the process series move between the two scrapes.
        assert abs(int(fields["content-length"]) - len(body)) < 64
        for path in ("/healthz", "/readyz"):
            status, fields, empty = await request(port, f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (status, empty) == (200, b"")
            assert int(fields["content-length"]) > 0


def test_the_guard_cap_is_absent_until_one_is_set() -> None:
    metrics = ReconcilerMetrics()
    assert "nri_qos_memory_guard_cap_bytes" not in prometheus_client.generate_latest(
        metrics.registry).decode()
    metrics.memory_guard(1 << 30, 1 << 29)
    assert value(parse(prometheus_client.generate_latest(metrics.registry).decode()),
                 "nri_qos_memory_guard_cap_bytes") == 1 << 30


def test_config_reloads_are_counted(tmp_path: Path) -> None:


    metrics = Metrics()
    path = tmp_path / "config.toml"
    path.write_text("")
    store = ConfigStore(AuditLog(MemoryAuditSink()))
    store.load_initial(str(path))
    store.on_load(lambda ok: metrics.config_reload(ok, 1234.0))
    path.write_text("[plugin]\nstrict = 1\n")
    store.reload()
    path.write_text("[plugin]\nstrict = true\n")
    store.reload()
    samples = parse(prometheus_client.generate_latest(metrics.registry).decode())
    assert value(samples, "nri_qos_config_reloads_total", result="failure") == 1
    assert value(samples, "nri_qos_config_reloads_total", result="success") == 1
    assert value(samples, "nri_qos_config_last_reload_success_timestamp_seconds") == 1234.0


async def test_connections_over_the_cap_are_closed_unanswered(
        caplog: pytest.LogCaptureFixture) -> None:
    async with Serving(Metrics()) as port:
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
        # Closed unanswered: an end of file, or a reset since the request was not read.
        with contextlib.suppress(ConnectionResetError):
            assert await reader.read() == b""
        writer.close()
        for _, idle_writer in idle:
            idle_writer.close()
        await asyncio.sleep(0.1)
        assert (await http_get(port, "/healthz"))[0] == 200
        still_open = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        await asyncio.sleep(0.1)
    # Stopped with handlers waiting on their clients: they end without a traceback.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    for _, writer in still_open:
        writer.close()


async def test_a_slow_client_is_cut_off_after_the_request_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Each byte in time for any per-read timeout, the whole request far too slow.
    monkeypatch.setattr(nri_plugin.report.metrics_server, "REQUEST_TIMEOUT_S", 0.5)
    async with Serving(Metrics()) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = asyncio.get_running_loop().time()
        with pytest.raises(ConnectionError):  # noqa: PT012 - the write that finds it closed
            for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.1)
                if reader.at_eof():
                    raise ConnectionResetError
        assert asyncio.get_running_loop().time() - started < 2.0
        writer.close()
