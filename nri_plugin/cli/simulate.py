"""``nri-qos simulate``: the real agent against a simulated runtime, to preview a node.

The agent is assembled as ``nri-qos run`` assembles it, from the same configuration, except that
the pods are not on this host: the background loops do not run (the answers still say which
settings they would apply) and resctrl is left alone. The answers are those of this host's
cgroup version, unless ``--cgroup v1|v2`` (or ``[memory] cgroup_version``) names another one to
preview. ``--runtime NAME/VERSION`` (and ``--nri-version``) impersonates a given
runtime: what it sends in Configure, which events it accepts and how it delivers them, so an
operator sees what a containerd 1.7.20 node would get before rolling out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from google.protobuf.json_format import MessageToDict

from common.aio import Backoff
from nri_plugin.agent import build_agent, load_store, probe, run_agent
from nri_plugin.config.loader import ConfigError
from nri_plugin.config.schema import Config
from nri_plugin.connection import run_external
from nri_plugin.obs.logs import LoggingSetup
from nri_plugin.session import adjustment
from nri_plugin.session.stub import PluginIdentity
from nri_plugin.sim.scenario import RuntimeSpec, Scenario, load_scenario
from nri_plugin.sim.simulator import Answer, RuntimeSimulator, initial_state, play
from nri_plugin.wire.errors import ConnectionClosed, RpcError
from nri_plugin.wire.runtime_support import RuntimeSupport, parse_version, runtime_nri_version
from protos import nri_api_pb2 as api
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.probe import HostInfo

READY_TIMEOUT_S = 15.0


def runtime_spec(text: str, nri_version: str | None = None) -> RuntimeSpec:
    """``containerd/v1.7.27`` -> what that runtime sends in Configure: its NRI version from
    NRI 0.12 on (inferred from containerd's own version when not given), its timeouts from NRI
    0.7 on. Raises ValueError for text that is not ``NAME/VERSION``."""
    name, sep, version = text.partition("/")
    if not sep or not name or not version:
        raise ValueError(f"--runtime must look like NAME/VERSION (e.g. containerd/v1.7.27), "
                         f"got {text!r}")
    nri = parse_version(nri_version) if nri_version else runtime_nri_version("", name, version)
    stated = nri_version or ""
    if not stated and nri is not None and nri >= (0, 12, 0):
        stated = "v" + ".".join(map(str, nri))
    timeouts = nri is not None and nri >= (0, 7, 0)
    return RuntimeSpec(name=name, version=version, nri_version=stated,
                       request_timeout_ms=2000 if timeouts else 0,
                       registration_timeout_ms=5000 if timeouts else 0)


def simulated_host(host: HostInfo, cfg: Config, cgroup: str | None = None) -> HostInfo:
    """This host, as far as the answers depend on it, for pods that are not on it: its own
    cgroup version unless ``cgroup`` (the command line) or the configuration names one."""
    wanted = cgroup or cfg.memory.cgroup_version
    version = host.cgroup.version if wanted == "auto" else int(wanted.removeprefix("v"))
    return dataclasses.replace(host, cgroup=CgroupLayout(version, host.cgroup.driver),
                               resctrl=None, resctrl_problem="not used by a simulation")


def header(runtime: RuntimeSpec, events: int, cfg: Config,
           reconciler_fields: frozenset[str], host: HostInfo) -> str:
    """What the simulated runtime said and which settings reach containers which way."""
    support = RuntimeSupport.detect(runtime.nri_version, runtime.name, runtime.version)
    routes = adjustment.routes(support, cfg.resctrl.clos_field, reconciler_fields)
    nri = runtime.nri_version or (
        f"not sent (v{'.'.join(map(str, support.nri_version))} inferred)"
        if support.nri_version else "unknown")
    lines = [
        f"# simulated runtime: {runtime.name} {runtime.version}, NRI {nri}; plugin subscribed "
        f"to events mask {events:#x}",
        f"# fields applied from the answer: {', '.join(routes['adjustment']) or 'none'} "
        f"({support.basis})",
        f"# fields the reconciler applies after start: {', '.join(routes['reconciler']) or 'none'}",
        f"# answers for cgroup v{host.cgroup.version}",
    ]
    if routes["none"]:
        lines.append(f"# fields not applied on this runtime: {', '.join(routes['none'])}")
    return "".join(line + "\n" for line in lines)


def print_answers(answers: Sequence[Answer], updates: Sequence[api.ContainerUpdate],
                  *, as_json: bool, out: TextIO) -> None:
    if as_json:
        for answer in answers:
            out.write(json.dumps(answer.as_dict(), sort_keys=True) + "\n")
        for update in updates:
            out.write(json.dumps({"update_containers": MessageToDict(update)}) + "\n")
        return
    for answer in answers:
        target = f"{answer.pod} {answer.container}".strip()
        if not answer.method:
            out.write(f"{answer.event:<24} {target:<40} not sent: the plugin did not subscribe\n")
            continue
        body = json.dumps(answer.response, sort_keys=True) if answer.response else "(empty)"
        out.write(f"{answer.event:<24} {target:<40} via {answer.method}: {body}\n")
    for update in updates:
        out.write(f"update_containers: {json.dumps(MessageToDict(update), sort_keys=True)}\n")


async def simulate(scenario: Scenario, config_path: str | None, log_level: str | None,
                   *, as_json: bool = False, cgroup: str | None = None,
                   out: TextIO = sys.stdout) -> int:
    """Run the agent in-process against a simulated runtime playing ``scenario``."""
    logging_setup = LoggingSetup(level=log_level)
    try:
        store = load_store(config_path, logging_setup)
        if store is None:
            return 2
        cfg = store.current
        host, sysfs = probe(cfg, logging_setup.audit)
        host = simulated_host(host, cfg, cgroup)
        agent = build_agent(store, logging_setup.audit, host, sysfs,
                            PluginIdentity(cfg.plugin.name, cfg.plugin.index),
                            run_background=False)
        pods, containers = initial_state(scenario)
        with tempfile.TemporaryDirectory(prefix="nri-qos-sim-") as tmp:
            socket_path = Path(tmp) / "nri.sock"
            simulator = RuntimeSimulator(socket_path, scenario.runtime, pods=pods,
                                         containers=containers)
            await simulator.start()
            stop = asyncio.Event()
            connection = functools.partial(run_external, socket_path=str(socket_path),
                                           backoff=Backoff(0.05, 1.0))
            async with asyncio.TaskGroup() as group:
                plugin = group.create_task(run_agent(agent, connection, stop))
                try:
                    peer = await simulator.wait_ready(timeout_s=READY_TIMEOUT_S)
                    await play(simulator, peer, scenario)
                except (TimeoutError, RpcError, ConnectionClosed) as exc:
                    out.write(f"simulation failed: {exc or type(exc).__name__}\n")
                    for connection_state in simulator.connections:
                        if connection_state.error:
                            out.write(f"runtime dropped the plugin: {connection_state.error}\n")
                    return 1
                finally:
                    stop.set()
                    await simulator.stop()
        if not as_json:
            out.write(header(scenario.runtime, peer.events, cfg, agent.reconciler_fields, host))
        print_answers(peer.answers, peer.updates, as_json=as_json, out=out)
        return plugin.result()
    finally:
        logging_setup.close()


def main_simulate(scenario_path: str | None, config_path: str | None, log_level: str | None,
                  runtime: str | None = None, nri_version: str | None = None, *,
                  cgroup: str | None = None, as_json: bool = False) -> int:
    """``nri-qos simulate [SCENARIO] [--runtime NAME/VERSION] [--cgroup v1|v2] [--json]``: play
    a scenario and print the agent's answers."""
    try:
        scenario = load_scenario(Path(scenario_path) if scenario_path else None)
        if runtime is not None or nri_version is not None:
            text = runtime or f"{scenario.runtime.name}/{scenario.runtime.version}"
            scenario = dataclasses.replace(scenario, runtime=runtime_spec(text, nri_version))
    except ConfigError as exc:
        sys.stderr.write(f"invalid scenario: {exc}\n")
        return 2
    except ValueError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    return asyncio.run(simulate(scenario, config_path, log_level, as_json=as_json,
                                cgroup=cgroup))
