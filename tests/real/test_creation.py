"""The creation answer on a real cgroup v2 kernel: the agent answers CreateContainer over the real
NRI protocol (the runtime simulator on a socket), a kubelet-like applier writes the answer's
``memory.min/low/high`` into real container cgroups, and the kernel's values are read back.

Per level, with the Volcano ``colocation-config`` ratios, and the Volcano reset of an emptied
annotation (``memory.high=max``, ``memory.low=0``, ``memory.min=0`` over kubelet's values).
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

from nri_plugin.cli.simulate import simulate
from nri_plugin.sim.scenario import load_scenario
from tests.support.builders import LEVEL
from tests.support.guest_node import CGROUP, MIB, Node

pytestmark = pytest.mark.vm(numa=2, mem_mib=2048)

PAGE = 4096
CONFIG = """
[memory.levels.shared_cores]
policy = "kubernetes"
throttling_factor = 0.8
low_ratio = 50
[memory.levels.dedicated_cores]
policy = "ratios"
min_ratio = 100
low_ratio = 0
high_ratio = 90
[memory.levels.reclaimed_cores]
policy = "ratios"
high_ratio = 95
"""
VOLCANO = "volcano.sh/colocation-config"
# name -> (tier, level annotation or "", extra annotation, limit MiB, request MiB)
PODS = {
    "shared": ("burstable", "shared_cores", "", 512, 256),
    "dedicated": ("guaranteed", "dedicated_cores", "", 256, 256),
    "reclaimed": ("besteffort", "reclaimed_cores", "", 1024, 0),
    "volcano": ("burstable", "shared_cores",
                f'{VOLCANO}={{"memoryQos": {{"highRatio": 60, "lowRatio": 40, "minRatio": 10}}}}',
                512, 256),
    "reset": ("burstable", "shared_cores", f"{VOLCANO}=", 512, 256),
}


def uid(n: int) -> str:
    return f"c0c0c0c0-0000-4000-8000-{n:012d}"


def scenario_text() -> str:
    parts = ['[runtime]\nname = "containerd"\nversion = "v2.4.0"\nnri_version = "v0.12.2"\n']
    for n, (name, (tier, level, extra, limit, request)) in enumerate(PODS.items()):
        parent = f"/kubepods/pod{uid(n)}" if tier == "guaranteed" \
            else f"/kubepods/{tier}/pod{uid(n)}"
        annotations = [f"{LEVEL}={level}"] + ([extra] if extra else [])
        parts.append(f'[[pods]]\nid = "sb-{name}"\nuid = "{uid(n)}"\nname = "{name}"\n'
                     f'namespace = "test"\ncgroup_parent = "{parent}"\n'
                     f"annotations = {json.dumps(annotations)}\n")
        parts.append(f'[[containers]]\nid = "{name}-ctr"\npod = "sb-{name}"\nname = "c"\n'
                     f"memory_limit = {limit * MIB}\nmemory_min = {request * MIB}\n")
        parts.append(f'[[steps]]\nevent = "run_pod_sandbox"\npod = "sb-{name}"\n'
                     f'[[steps]]\nevent = "create_container"\ncontainer = "{name}-ctr"\n')
    return "".join(parts)


def answers(tmp_path: Path) -> dict[str, dict[str, str]]:
    """Each container's ``unified`` settings as the agent answered CreateContainer."""
    (tmp_path / "scenario.toml").write_text(scenario_text())
    (tmp_path / "config.toml").write_text(CONFIG)
    out = io.StringIO()
    status = asyncio.run(simulate(load_scenario(tmp_path / "scenario.toml"),
                                  str(tmp_path / "config.toml"), "warning", as_json=True,
                                  out=out))
    assert status == 0, out.getvalue()
    found: dict[str, dict[str, str]] = {}
    for line in out.getvalue().splitlines():
        answer = json.loads(line)
        if answer.get("event") != "create_container":
            continue
        linux = (answer.get("response") or {}).get("adjust", {}).get("linux", {})
        found[answer["pod"].split("/", 1)[1]] = linux.get("resources", {}).get("unified", {})
    return found


def pages(value: float) -> str:
    return str(int(value) // PAGE * PAGE)


def test_memory_qos_answers_are_what_the_kernel_holds(node: Node, tmp_path: Path) -> None:
    got = answers(tmp_path)
    assert set(got) == set(PODS), got
    # kubelet's MemoryQoS formula with factor 0.8: request + 0.8 x (limit - request)
    assert got["shared"] == {"memory.high": pages((256 + 0.8 * 256) * MIB),
                             "memory.low": pages(128 * MIB)}
    assert got["dedicated"] == {"memory.min": pages(256 * MIB),
                                "memory.high": pages(0.9 * 256 * MIB)}
    assert got["reclaimed"] == {"memory.high": pages(0.95 * 1024 * MIB)}
    # Volcano's ratios, memory.high never above the level's own
    assert got["volcano"] == {"memory.high": pages(0.6 * 512 * MIB),
                              "memory.low": pages(0.4 * 256 * MIB),
                              "memory.min": pages(0.1 * 256 * MIB)}
    # The emptied annotation resets what the level's policy does not set.
    assert got["reset"]["memory.min"] == "0"
    assert got["reset"]["memory.high"] == pages((256 + 0.8 * 256) * MIB)
    assert got["reset"]["memory.low"] == pages(128 * MIB)

    for n, (name, (tier, *_rest, request)) in enumerate(PODS.items()):
        cgroup, _ = node.container(tier, uid(n), f"{name}-ctr")
        # kubelet's own values first (MemoryQoS: memory.min = request), then the answer's
        (cgroup / "memory.min").write_text(str(request * MIB))
        for key, value in got[name].items():
            (cgroup / key).write_text(value)
        for key, value in got[name].items():
            assert (cgroup / key).read_text().strip() == value, (name, key)
    reset = CGROUP / f"kubepods/burstable/pod{uid(4)}/reset-ctr"
    assert (reset / "memory.min").read_text().strip() == "0"
