"""Metrics: the agent's own registry and each series recorded where the work happens.

The end-to-end test runs the agent as ``nri-qos run`` assembles it, on a fake host tree, against
the runtime simulator over a real socket, and scrapes the endpoint over HTTP before and after a
pod lifecycle and reconcile cycles: every series must exist and move.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import platform
import socket
from pathlib import Path

import prometheus_client
import pytest

from common.aio import Backoff
from common.audit import AuditLog, MemoryAuditSink
from common.metrics import Metrics, PluginMetrics
from hooks.events import Event
from nri_plugin.agent import build_agent, load_store, probe, run_agent
from nri_plugin.connection import run_external
from nri_plugin.obs.logs import LoggingSetup
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
from tests.support.metrics_http import Samples, http_get, parse, until, value
from tests.support.resctrl_trees import intel_tree

UID_A = "0a0a0a0a-1111-2222-3333-444444444444"
UID_B = "0b0b0b0b-1111-2222-3333-444444444444"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


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
        # A loop's first cycle may come after readiness (the answers do not wait for the
        # loops), later still on a loaded machine.
        await until(lambda: all(name in agent.tracker.last() for name in loops))
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
