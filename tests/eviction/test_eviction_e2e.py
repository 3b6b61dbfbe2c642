"""End to end: the agent as the daemon builds it, connected to the runtime simulator, on a fake
host tree, with the pod watch and the evictions going to the fake API server.

The RSS-overuse detector is not part of this agent yet, so the test plays its part: it reads each
pod's anonymous memory from the fake tree, compares it with request x 1.05 (the detector's
default factor) and publishes ``rss_overuse`` readings on the agent's board, as the detector will.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest

from common.aio import Backoff
from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.agent import build_agent, probe, run_agent
from nri_plugin.config.loader import parse_toml
from nri_plugin.config.schema import Config
from nri_plugin.config.store import ConfigStore
from nri_plugin.connection import run_external
from nri_plugin.session.stub import PluginIdentity
from nri_plugin.sim.simulator import RuntimeSimulator
from reconciler.detection.signals import Board, Level, Reading, pod_scope
from reconciler.host.memstat import anon_bytes
from tests.support.builders import LEVEL
from tests.support.fake_apiserver import FakeApiServer, make_pod, write_kubeconfig
from tests.support.fakesys import FakeHost, FakePod, nri_messages

GIB = 1 << 30
FACTOR = 1.05
OFFLINE_UID = "0f0f0f0f-1111-2222-3333-444444444444"
ONLINE_UID = "0e0e0e0e-1111-2222-3333-444444444444"


def config_text(root: Path, kubeconfig: Path, plugins: Path, dry_run: bool) -> str:
    return (
        '[agent]\nmode = "enforce"\n'
        "[reconciler]\n"
        f'root = "{root}"\n'
        # Below the fake host too: the default is the machine's own agent's state file.
        f'state_dir = "{root}/var/lib/nri-qos/state"\n'
        "drift_interval_s = 0.5\n"
        "[resctrl]\nenabled = false\n"
        "[kubernetes]\n"
        f'kubeconfig = "{kubeconfig}"\n'
        'node_name = "node-a"\n'
        "request_timeout_s = 5.0\n"
        "retry_max_s = 0.2\n"
        "[eviction]\n"
        f"dry_run = {'true' if dry_run else 'false'}\n"
        "interval_s = 0.1\n"
        f'plugin_dir = "{plugins}"\n'
        "[plugin]\nreconnect_initial_ms = 20\n"
    )



def rss_readings(host: FakeHost, pods: list[FakePod], request: int) -> list[Reading]:
    """What the RSS-overuse detector would publish for these pods."""
    readings = []
    for pod in pods:
        stat = (host.cg("memory", host.pod_rel(pod.tier, pod.info.uid)) / "memory.stat")
        anon = anon_bytes(stat.read_text(), v2=False)
        assert anon is not None
        threshold = request * FACTOR
        level = Level.HIGH if anon > threshold else Level.NONE
        readings.append(Reading("rss_overuse", pod_scope(pod.info.uid), level, float(anon),
                                threshold, "bytes", pod_uid=pod.info.uid))
    return readings


async def until(predicate: object, timeout_s: float = 20.0) -> None:
    assert callable(predicate)
    async with asyncio.timeout(timeout_s):
        # The condition is a request the fake API server records from its own thread.
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("dry_run", [False, True])
async def test_an_offline_pod_over_its_request_is_evicted_an_online_one_never(
    tmp_path: Path, dry_run: bool
) -> None:
    host = FakeHost(tmp_path / "host")
    offline = host.add_pod(OFFLINE_UID, tier="besteffort", name="train", namespace="batch",
                           annotations={LEVEL: "reclaimed_cores"})
    online = host.add_pod(ONLINE_UID, tier="burstable", name="web", namespace="shop",
                          annotations={LEVEL: "shared_cores"})
    # Both use more anonymous memory than request x factor; only one of them is offline.
    host.set_pod_anon(offline, 2 * GIB, cache=GIB)
    host.set_pod_anon(online, 3 * GIB)
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    with FakeApiServer() as fake:
        fake.add_node("node-a")
        for pod, level, ns in ((offline, "reclaimed_cores", "batch"),
                               (online, "shared_cores", "shop")):
            fake.add_pod(make_pod(pod.info.name, namespace=ns, uid=pod.info.uid,
                                  priority=0,
                                  annotations={LEVEL: level},
                                  memory={"c0": ("1Gi", None)}))
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url)
        cfg: Config = parse_toml(Config, config_text(host.root, kubeconfig,
                                                     tmp_path / "plugins", dry_run))
        store = ConfigStore(audit, config=cfg)
        found, sysfs = probe(cfg, audit)
        agent = build_agent(store, audit, found, sysfs, PluginIdentity("nri-qos", "10"),
                            run_background=True)
        assert agent.evictor is not None
        board: Board = agent.board

        pods, containers = [], []
        for pod in (offline, online):
            sandbox, running = nri_messages(pod)
            pods.append(sandbox)
            containers += running
        socket_path = tmp_path / "nri.sock"
        simulator = RuntimeSimulator(socket_path, pods=pods, containers=containers)
        await simulator.start()
        stop = asyncio.Event()
        connection = functools.partial(run_external, socket_path=str(socket_path),
                                       backoff=Backoff(0.05, 0.1))
        task = asyncio.create_task(run_agent(agent, connection, stop))
        try:
            await simulator.wait_ready()
            board.publish("rss_overuse", rss_readings(host, [offline, online], GIB))
            if dry_run:
                await until(lambda: bool(sink.named("eviction_dry_run")))
            else:
                await until(lambda: bool(fake.events()))
            # A few more rounds: the online pod is still never proposed, nothing twice.
            await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)
            await simulator.stop()

    chosen = sink.named("eviction_chosen")
    assert [c["pod"] for c in chosen] == ["batch/train"]
    assert chosen[0]["plugin"] == "rss_overuse"
    assert chosen[0]["dry_run"] is dry_run
    assert chosen[0]["memory_usage_bytes"] == 2 * GIB  # anonymous memory, not the page cache
    assert f"over {int(GIB * FACTOR)} B" in chosen[0]["reason"]
    assert [c["pod"] for c in sink.named("eviction_candidate")] == ["batch/train"]
    evictions = [r for r in fake.requests("POST") if r.path.endswith("/eviction")]
    if dry_run:
        assert evictions == []
        assert fake.events() == []
        assert [d["pod"] for d in sink.named("eviction_dry_run")] == ["batch/train"]
    else:
        assert [r.path for r in evictions] == ["/api/v1/namespaces/batch/pods/train/eviction"]
        assert evictions[0].body["deleteOptions"]["gracePeriodSeconds"] == 1
        (event,) = fake.events()
        assert event["involvedObject"]["uid"] == OFFLINE_UID
        assert event["message"].startswith("Evicted by nri-qos, plugin rss_overuse: "
                                           "anonymous memory")
        assert [d["pod"] for d in sink.named("eviction_done")] == ["batch/train"]
