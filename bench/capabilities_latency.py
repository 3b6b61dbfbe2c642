"""CreateContainer latency with every creation-time capability enabled.

Builds a fake Intel resctrl tree in a temporary directory, enables resctrl (class groups and a
pod group with its monitoring hook), memory QoS (v2), oom score and an OCI hook, then measures:

* the hook chain alone, in process (policies + merge), and
* the CreateContainer round trip through a real unix socket against the runtime simulator,
  sequentially.

Prints p50/p99/max in milliseconds and calls per second.

    python bench/capabilities_latency.py [--calls 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hooks.model import ContainerInfo, PodInfo, RuntimeInfo
from hooks.settings import merge
from nri_plugin.audit import AuditLog, MemoryAuditSink
from nri_plugin.capabilities import build_hooks, setup_class_groups
from nri_plugin.chain import ContainerEvent, Hook, PodEvent
from nri_plugin.config.loader import parse_toml
from nri_plugin.config.schema import Config
from nri_plugin.events import Event
from nri_plugin.scenario import RuntimeSpec
from nri_plugin.simulator import RuntimeSimulator
from nri_plugin.stub import PluginIdentity, PluginStub
from protos import nri_api_pb2 as api
from reconciler.resctrlfs import ResctrlFs
from tests.resctrl_trees import intel_tree

UID = "0c9f3b1e-7a2d-4c11-8e5f-2b6d4a8c1e90"
RESCTRL = '{"LLC":{"schemata":{"range":[0,20]}},"MB":{"schemata":{"percent":20}}}'


def report(name: str, samples: list[float]) -> None:
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    total = sum(samples)
    print(f"{name}: n={len(samples)} p50={statistics.median(samples) * 1e3:.3f} ms "
          f"p99={p99 * 1e3:.3f} ms max={samples[-1] * 1e3:.3f} ms "
          f"rate={len(samples) / total:.0f}/s")


def setup(tmp: Path) -> tuple[Config, list[Hook], AuditLog]:
    root = intel_tree(tmp / "resctrl")
    tool = tmp / "nri-qos-hook"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    os.chown(tool, 0, 0)
    config: Config = parse_toml(Config, f"""
[resctrl]
root = "{root}"
[resctrl.monitor_hook]
enabled = true
path = "{tool}"
[memory]
cgroup_version = "v2"
[oom]
priority_ordering = true
[[oci_hooks.levels.shared_cores.prestart]]
path = "{tool}"
""")
    audit = AuditLog(MemoryAuditSink())
    fs = ResctrlFs.detect(root, prefix=config.resctrl.group_prefix, audit=audit,
                          amd_mb_max=2048, warn=print)
    assert fs is not None
    setup_class_groups(config.resctrl, fs, warn=print)
    return config, build_hooks(config, resctrl=fs, audit=audit, cgroup_v2=True), audit


def in_process(hooks: list[Hook], calls: int) -> list[float]:
    pod = PodInfo(id="sb", uid=UID, name="p", namespace="ns",
                  annotations={"node.koordinator.sh/resctrl": RESCTRL,
                               "volcano.sh/colocation-config": '{"memoryQos":{"highRatio":90}}'})
    runtime = RuntimeInfo(nri_version=(0, 12, 2), cgroup_v2=True)
    for hook in hooks:
        hook.run_pod_sandbox(PodEvent(pod, "shared_cores", runtime))
    event = ContainerEvent(pod, ContainerInfo(id="c", pod_sandbox_id="sb", name="app",
                                              memory_limit=512 << 20, memory_request=256 << 20,
                                              oom_score_adj=900),
                           "shared_cores", runtime)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        merge([(h.name, h.create_container(event)) for h in hooks])
        samples.append(time.perf_counter() - start)
    return samples


async def round_trip(config: Config, hooks: list[Hook], audit: AuditLog, tmp: Path,
                     calls: int) -> list[float]:
    sock = tmp / "nri.sock"
    simulator = RuntimeSimulator(sock, RuntimeSpec())
    await simulator.start()
    executor = ThreadPoolExecutor(max_workers=4)
    stub = PluginStub(identity=PluginIdentity("nri-qos", "10"), config=lambda: config,
                      hooks=hooks, audit=audit, executor=executor)
    reader, writer = await asyncio.open_unix_connection(str(sock))
    serving = asyncio.create_task(stub.serve(reader, writer))
    conn = await simulator.wait_ready()
    pod = api.PodSandbox(id="sb", uid=UID, name="p", namespace="ns",
                         annotations={"node.koordinator.sh/resctrl": RESCTRL,
                                      "qos.nri-qos.io/level": "shared_cores"})
    ctr = api.Container(id="c", pod_sandbox_id="sb", name="app")
    ctr.linux.resources.memory.limit.value = 512 << 20
    await simulator.send(conn, Event.RUN_POD_SANDBOX, pod)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        await simulator.send(conn, Event.CREATE_CONTAINER, pod, ctr)
        samples.append(time.perf_counter() - start)
    stub.close()
    await serving
    await simulator.stop()
    executor.shutdown()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    import logging

    import structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        config, hooks, audit = setup(tmp)
        print("hooks:", ", ".join(h.name for h in hooks))
        report("chain in process", in_process(hooks, args.calls))
        report("CreateContainer round trip", asyncio.run(
            round_trip(config, hooks, audit, tmp, args.calls)))


if __name__ == "__main__":
    main()
