"""The daemon as `nri-qos run` starts it: NRI stub and reconciler together, on a fake host root."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hooks.events import Event
from nri_plugin.sim.scenario import RuntimeSpec
from nri_plugin.sim.simulator import RuntimeSimulator
from protos import nri_api_pb2 as api
from tests.support.builders import LEVEL
from tests.support.fakesys import FakeHost, nri_messages, read_ids
from tests.support.serving import serving_daemon


def config_for(root: Path, mode: str = "enforce") -> str:
    return (
        f'[agent]\nmode = "{mode}"\n'
        "[reconciler]\n"
        f'root = "{root}"\n'
        # Below the fake host too: the default is the machine's own agent's state file.
        f'state_dir = "{root}/var/lib/nri-qos/state"\n'
        "resctrl_interval_s = 0.1\n"
        "drift_interval_s = 0.1\n"
        "[memory_guard]\n"
        "interval_s = 0.1\n"
        "[numa]\n"
        "interval_s = 0.1\n"
        "[kubernetes]\n"
        "enabled = false\n"
        "[plugin]\n"
        "reconnect_initial_ms = 20\n"
        "[status]\n"
        "enabled = false\n"
    )



def ids(path: Path) -> set[int]:
    """Task ids in a resctrl ``tasks`` file (the kernel creates it with the group; a fake tree
    gets it with the first write)."""
    return set(read_ids(path)) if path.exists() else set()


async def until(predicate: object, what: str, timeout_s: float = 15.0) -> None:
    assert callable(predicate)
    async with asyncio.timeout(timeout_s):
        # Polling: the condition is a file the reconciler writes from its own thread.
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_run_wires_state_tracking_into_the_reconciler(tmp_path: Path) -> None:
    root = tmp_path / "host"
    host = FakeHost(root)
    resctrl = host.make_resctrl()
    existing = host.add_pod("0a0a0a0a-1111-2222-3333-444444444444", tier="besteffort",
                            annotations={LEVEL: "reclaimed_cores"}, threads=3)
    created = host.add_pod("0b0b0b0b-1111-2222-3333-444444444444", tier="besteffort",
                           annotations={LEVEL: "reclaimed_cores"}, threads=2)
    config = tmp_path / "config.toml"
    config.write_text(config_for(root))

    pod_a, containers_a = nri_messages(existing)
    simulator = RuntimeSimulator(tmp_path / "nri.sock", pods=[pod_a], containers=containers_a)
    async with serving_daemon(config, simulator) as run:
        connection = run.connection
        group_tasks = resctrl / "nriqos-reclaimed_cores" / "tasks"
        # The class group exists from startup; the pod known from Synchronize has its threads
        # moved in and its processes' oom_score_adj repaired by drift.
        wanted = set(existing.containers[0].tids)
        await until(lambda: wanted <= ids(group_tasks), "synchronized pod's tasks")
        pid = existing.containers[0].pids[0]
        await until(lambda: (root / f"proc/{pid}/oom_score_adj").read_text().strip() == "1000",
                    "drift of oom_score_adj")

        # A pod created while connected: the adjustment names the class group, and the
        # reconciler, woken by the event, puts the container's threads there.
        pod_b, containers_b = nri_messages(created)
        await simulator.send(connection, Event.RUN_POD_SANDBOX, pod_b)
        response = await simulator.send(connection, Event.CREATE_CONTAINER, pod_b,
                                        containers_b[0])
        assert isinstance(response, api.CreateContainerResponse)
        # NRI 0.12 runtimes take the CLOS through linux.rdt.clos_id.
        assert response.adjust.linux.rdt.clos_id.value == "nriqos-reclaimed_cores"
        assert response.adjust.linux.oom_score_adj.value == 1000
        await simulator.send(connection, Event.START_CONTAINER, pod_b,
                             containers_b[0])
        wanted_b = set(created.containers[0].tids)
        await until(lambda: wanted_b <= ids(group_tasks), "created pod's tasks")
    assert run.status == 0


async def test_old_containerd_gets_oom_score_adj_from_the_reconciler_after_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # containerd 1.7.20 (NRI 0.6.1) drops oom_score_adj from an adjustment: the answer leaves it
    # out, and the drift loop, woken by StartContainer, writes it to the container's processes.
    root = tmp_path / "host"
    host = FakeHost(root)
    host.make_resctrl()
    pod = host.add_pod("0c0c0c0c-1111-2222-3333-444444444444", tier="besteffort",
                       annotations={LEVEL: "reclaimed_cores"})
    config = tmp_path / "config.toml"
    config.write_text(config_for(root).replace("drift_interval_s = 0.1", "drift_interval_s = 600"))
    simulator = RuntimeSimulator(tmp_path / "nri.sock", RuntimeSpec(
        version="v1.7.20", nri_version="", request_timeout_ms=0, registration_timeout_ms=0))
    async with serving_daemon(config, simulator, "info") as run:
        connection = run.connection
        pod_msg, containers = nri_messages(pod)
        await simulator.send(connection, Event.RUN_POD_SANDBOX, pod_msg)
        response = await simulator.send(connection, Event.CREATE_CONTAINER, pod_msg,
                                        containers[0])
        assert isinstance(response, api.CreateContainerResponse)
        assert not response.adjust.linux.HasField("oom_score_adj")
        pid = pod.containers[0].pids[0]
        oom = root / f"proc/{pid}/oom_score_adj"
        assert oom.read_text().strip() != "1000"
        await simulator.send(connection, Event.START_CONTAINER, pod_msg, containers[0])
        # The drift period is 10 minutes: only the StartContainer wake-up can do it in time.
        await until(lambda: oom.read_text().strip() == "1000", "oom_score_adj after start")
    assert run.status == 0
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines()
               if line.startswith("{")]
    routes = next(r for r in records if r.get("event") == "runtime_fields")
    assert "oom_score_adj" in routes["via_reconciler"]
    deferred = [r for r in records if r.get("event") == "adjustment_deferred"]
    assert [(r["field"], r["container"]) for r in deferred] == [
        ("oom_score_adj", pod.containers[0].info.name)]
    written = [r for r in records if r.get("event") == "cgroup_write"
               and r["path"] == f"/proc/{pid}/oom_score_adj"]
    assert written[0]["value"] == "1000"
    assert "runtime does not apply oom_score_adj at creation" in written[0]["reason"]


async def test_observe_mode_answers_at_creation_and_writes_nothing_else(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The same node as above in observe mode: the creation answer still carries every setting,
    # but no running container's task ids or oom_score_adj are touched, the class group keeps
    # the kernel's schemata, and each held-back write is audited once.
    root = tmp_path / "host"
    host = FakeHost(root)
    resctrl = host.make_resctrl()
    existing = host.add_pod("0d0d0d0d-1111-2222-3333-444444444444", tier="besteffort",
                            annotations={LEVEL: "reclaimed_cores"}, threads=3)
    created = host.add_pod("0e0e0e0e-1111-2222-3333-444444444444", tier="besteffort",
                           annotations={LEVEL: "reclaimed_cores"}, threads=2)
    config = tmp_path / "config.toml"
    config.write_text(config_for(root, mode="observe"))
    pid = existing.containers[0].pids[0]
    oom = root / f"proc/{pid}/oom_score_adj"
    oom_before = oom.read_text()
    pod_a, containers_a = nri_messages(existing)
    simulator = RuntimeSimulator(tmp_path / "nri.sock", pods=[pod_a], containers=containers_a)
    async with serving_daemon(config, simulator, "info") as run:
        connection = run.connection
        pod_b, containers_b = nri_messages(created)
        await simulator.send(connection, Event.RUN_POD_SANDBOX, pod_b)
        response = await simulator.send(connection, Event.CREATE_CONTAINER, pod_b,
                                        containers_b[0])
        assert isinstance(response, api.CreateContainerResponse)
        assert response.adjust.linux.rdt.clos_id.value == "nriqos-reclaimed_cores"
        assert response.adjust.linux.oom_score_adj.value == 1000
        # Several reconciler cycles (0.1 s each) decide the same writes again.
        await asyncio.sleep(1.0)
    assert run.status == 0
    group = resctrl / "nriqos-reclaimed_cores"
    assert group.is_dir()
    assert ids(group / "tasks") == set()
    assert not (group / "schemata").exists()
    assert oom.read_text() == oom_before
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines()
               if line.startswith("{")]
    assert not [r for r in records if r.get("event") in ("cgroup_write", "tasks_moved")]
    observed = [(r["path"], r["value"]) for r in records if r.get("event") == "write_observed"]
    assert (f"/proc/{pid}/oom_score_adj", "1000") in observed
    assert any(path.endswith("/tasks") for path, _ in observed)
    assert len(observed) == len(set(observed))
    # Every record about a pod names it fully, and joins with the per-request line.
    about_pods = [r for r in records if r.get("audit") and ("pod_uid" in r or "pod" in r)]
    assert about_pods
    for r in about_pods:
        assert {"pod_uid", "pod_namespace", "pod_name"} <= set(r), r
    (applied,) = [r for r in records if r.get("event") == "adjustment_applied"]
    (line,) = [r for r in records if r.get("event") == "nri_event"
               and r.get("nri_event") == "create_container"]
    assert (line["pod_uid"], line["pod_namespace"], line["pod_name"]) == (
        applied["pod_uid"], applied["pod_namespace"], applied["pod_name"])
    assert line["pod"] == f"{applied['pod_namespace']}/{applied['pod_name']}"
