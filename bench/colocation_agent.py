"""The agent of the colocation benchmark's agent modes: a real ``nri-qos run`` child process beside
the runtime simulator and a fake API server, and what a runtime does with its answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.agent_env import agent_command
from bench.colocation_machine import RUNTIME_SOCKET, STATUS_SOCKET
from bench.colocation_plan import AGENT, OFFLINE, ONLINE, PodPlan
from bench.kubelet_node import MIB, Container, KubeletNode
from hooks.events import Event
from nri_plugin.cli.status import NoAgent, fetch
from nri_plugin.config.loader import drop_in_dir
from nri_plugin.sim.scenario import ContainerSpec, PodSpec
from nri_plugin.sim.simulator import (
    PluginConnection,
    RuntimeSimulator,
    container_message,
    pod_message,
)
from protos import nri_api_pb2 as api
from tests.support.fake_apiserver import FakeApiServer, make_pod, write_kubeconfig
from tests.support.processes import cpu_seconds

NODE_NAME = "colocation-node"
READY_TIMEOUT_S = 120.0
"""For the agent to be synchronized, and for the online pod to have read its files."""
CREATION_ONLY = "[detection]\nenabled = false\n[mitigation]\nenabled = false\n"
"""The configuration of the agent-creation mode: the creation answers, the guard and drift
repair; no detection, no ladder."""
API_POLL_S = 0.5
"""How often the API server stand-in's thread wakes to look for a shutdown: its wake-ups are
CPU taken on the node measured, which a real API server, elsewhere, does not take."""


class Agent:
    """A real ``nri-qos run`` process (in a DaemonSet-like pod of the node) beside the
    runtime simulator and a fake API server; an async context manager: entered, the agent is
    synchronized and settled; left, all is gone."""

    def __init__(self, node: KubeletNode, work: Path, source: Path, *,
                 creation_only: bool = False,
                 plans: tuple[PodPlan, ...] = (ONLINE, OFFLINE), drop_in: str = "",
                 variant: str = "", profile: bool = False) -> None:
        self.node = node
        # Every thread of the agent profiled into the work directory (bench/agent_profile.py).
        self.profile = work / "profile" if profile else None
        self.drop_in = drop_in
        self.variant = variant
        self.plans = plans
        self.creation_only = creation_only
        self.source = source
        self.work = work
        self.audit_file = work / "audit.jsonl"
        self.log_file = work / "agent.log"
        self.socket = work / RUNTIME_SOCKET
        self.simulator = RuntimeSimulator(self.socket)
        self.connection: PluginConnection | None = None
        self.pid: int | None = None
        self.pod_rel: str | None = None
        self._stack = contextlib.AsyncExitStack()

    def config(self, root: Path, kubeconfig: Path) -> str:
        return (
            "# Everything not set here keeps its default (deploy/config.toml); the agent acts\n"
            "# (enforce), where a first install only observes.\n"
            '[agent]\nmode = "enforce"\n'
            f'[reconciler]\nroot = "{root}"\n'
            f'[kubernetes]\nkubeconfig = "{kubeconfig}"\nnode_name = "{NODE_NAME}"\n'
            f'[logging]\naudit_file = "{self.audit_file}"\n'
            f'[status]\nsocket = "{self.work / STATUS_SOCKET}"\n'
            + (CREATION_ONLY if self.creation_only else "")
        )

    def write_config(self, root: Path, kubeconfig: Path) -> Path:
        """The agent's configuration file, the ``--agent-config`` settings over it as a drop-in
        (applied as an operator's drop-in file is) and a variant's over those; the file's
        path."""
        config = self.work / "config.toml"
        config.write_text(self.config(root, kubeconfig))
        for name, text in (("50-given.toml", self.drop_in), ("60-variant.toml", self.variant)):
            if text:
                drop_in_dir(config).mkdir(exist_ok=True)
                (drop_in_dir(config) / name).write_text(text)
        return config

    async def __aenter__(self) -> Agent:
        async with contextlib.AsyncExitStack() as stack:
            server = stack.enter_context(FakeApiServer(poll_interval_s=API_POLL_S))
            server.add_node(NODE_NAME)
            for plan in (AGENT, *self.plans):
                memory = {"main": (_quantity(plan.memory_request), _quantity(plan.memory_limit))}
                server.add_pod(make_pod(plan.name, namespace=plan.namespace, node=NODE_NAME,
                                        uid=plan.uid, memory=memory))
            kubeconfig = write_kubeconfig(self.work / "kubeconfig", server.url)
            config = self.write_config(self.node.agent_root(self.work), kubeconfig)
            await self.simulator.start()
            stack.push_async_callback(self.simulator.stop)
            log = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            stack.callback(os.close, log)
            # As deploy/ runs it: a DaemonSet pod of the node (a run killed outright does not
            # leave it behind: the next run's sweep ends what is left in the node), Burstable
            # with the manifest's requests and limit, so its CPU weight is the request's, as on
            # a node (in a cgroup of the system's weight its bursts of work preempted the online
            # pod). Its oom_score_adj is inherited: lowering it needs CAP_SYS_RESOURCE, which a
            # test machine may lack.
            pod = self.node.add_pod(AGENT.tier, AGENT.uid, AGENT.container_id,
                                    memory_limit=AGENT.memory_limit,
                                    cpu_request_milli=AGENT.cpu_request_milli)
            # With only the packages the image installs (bench/agent_env.py says why).
            command, env = agent_command(self.source, self.work / "agent-env",
                                         profile=self.profile)
            process = await asyncio.create_subprocess_exec(
                *self.node.inside(pod.rel, [
                    *command, "run", "--config", str(config), "--socket", str(self.socket)],
                    None),
                cwd=self.source, stdout=log, stderr=log, env=env)
            stack.push_async_callback(_terminate, process)
            self.pid = process.pid
            self.pod_rel = pod.rel
            # The runtime lists the agent's own container, running, when it connects: the
            # agent's reconciler gives it what its level gives any running container.
            sandbox, own = own_messages(pod, process.pid)
            self.simulator.pods.append(sandbox)
            self.simulator.containers.append(own)
            self.connection = await self.simulator.wait_ready(timeout_s=READY_TIMEOUT_S)
            # Settled: the ladder's release of every rung at start (four records), detection's
            # first cycle (the memcg event registrations) after that; without the ladder, the
            # first memory guard cycle.
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not await self._settled():
                if time.monotonic() > deadline or process.returncode is not None:
                    raise RuntimeError(f"the agent did not settle; see {self.log_file}")
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.5)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _settled(self) -> bool:
        if self.creation_only:
            # From the status socket, not the audit trail: a cycle may write nothing (on cgroup
            # v2 the guard holds no standing cap by default).
            try:
                document = await asyncio.to_thread(fetch, str(self.work / STATUS_SOCKET))
            except NoAgent:
                return False
            guard = document["reconciler"]["loops"].get("memory_guard")
            return guard is not None and guard["cycles"] >= 1
        events = [event for _, event, _ in self.records()]
        return events.count("mitigation_action") >= 4

    async def create(self, plan: PodPlan, container: Container) -> api.ContainerAdjustment:
        """RunPodSandbox and CreateContainer for a pod; the adjustment to apply."""
        assert self.connection is not None
        pod, message = _messages(plan, container, api.CONTAINER_CREATED)
        await self.simulator.send(self.connection, Event.RUN_POD_SANDBOX, pod)
        answer = await self.simulator.send(self.connection, Event.CREATE_CONTAINER, pod, message)
        if isinstance(answer, api.CreateContainerResponse):
            return answer.adjust
        return api.ContainerAdjustment()

    async def started(self, plan: PodPlan, container: Container, pid: int) -> None:
        assert self.connection is not None
        pod, message = _messages(plan, container, api.CONTAINER_RUNNING)
        message.pid = pid
        await self.simulator.send(self.connection, Event.START_CONTAINER, pod, message)

    def cpu_seconds(self) -> float:
        """The CPU time the agent has used so far, its reaped children's included (the writers
        and movers it starts); 0 once it is gone."""
        if self.pid is None:
            return 0.0
        try:
            return cpu_seconds(self.pid, children=True)
        except OSError:
            return 0.0

    def peak_mib(self) -> float | None:
        """The most memory the agent's pod has held (its processes and the page cache they
        charged), MiB; None where the kernel does not say."""
        if self.pod_rel is None:
            return None
        peak = self.node.peak(self.pod_rel)
        return None if peak is None else peak / MIB

    def usage_mib(self) -> float | None:
        """The memory the agent's pod holds now (its processes and the page cache they charged
        that the kernel has not taken back), MiB."""
        if self.pod_rel is None:
            return None
        return self.node.usage(self.pod_rel) / MIB

    def records(self) -> list[tuple[float, str, dict[str, Any]]]:
        """The audit trail so far: (unix time, event, fields)."""
        if not self.audit_file.exists():
            return []
        found = []
        for line in self.audit_file.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                stamp = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00"))
                found.append((stamp.timestamp(), record["event"], record))
        return found


async def _terminate(process: asyncio.subprocess.Process) -> None:
    """Stop the agent as a service manager would: SIGTERM, then SIGKILL after 15 s."""
    if process.returncode is not None:
        return
    process.terminate()
    try:
        await asyncio.wait_for(process.wait(), 15)
    except TimeoutError:
        process.kill()
        await process.wait()


def _quantity(value: int | None) -> str | None:
    return None if value is None else f"{value // MIB}Mi"


def own_messages(container: Container, pid: int) -> tuple[api.PodSandbox, api.Container]:
    """The agent's own pod and container (running, ``pid``) as the runtime lists them at
    Synchronize."""
    sandbox, own = _messages(AGENT, container, api.CONTAINER_RUNNING)
    own.pid = pid
    return sandbox, own


def _messages(plan: PodPlan, container: Container,
              state: int) -> tuple[api.PodSandbox, api.Container]:
    spec = PodSpec(id=f"sandbox-{plan.name}", uid=plan.uid, name=plan.name,
                   namespace=plan.namespace, cgroup_parent=f"/{container.pod_rel}")
    ctr = ContainerSpec(id=plan.container_id, pod=spec.id, name="main",
                        memory_limit=plan.memory_limit or 0)
    return pod_message(spec), container_message(ctr, spec, state)


def apply_adjustment(node: KubeletNode, container: Container, adjust: api.ContainerAdjustment,
                     oom_score_adj: int) -> tuple[int, list[str]]:
    """What the runtime does with a CreateContainer answer: the oom_score_adj to start the
    container with and the memory settings of its cgroup; also what was applied, as text."""
    applied: list[str] = []
    linux = adjust.linux
    if linux.HasField("oom_score_adj"):
        oom_score_adj = linux.oom_score_adj.value
        applied.append(f"oom_score_adj={oom_score_adj}")
    memory = linux.resources.memory
    if memory.HasField("limit"):
        node.set_limit(container.rel, memory.limit.value)
        applied.append(f"memory limit={memory.limit.value}")
    if memory.HasField("reservation"):
        name = "memory.low" if node.v2 else "memory.soft_limit_in_bytes"
        (node.memory / container.rel / name).write_text(str(memory.reservation.value))
        applied.append(f"{name}={memory.reservation.value}")
    for key, value in linux.resources.unified.items():
        if node.v2:
            (node.memory / container.rel / key).write_text(value)
            applied.append(f"{key}={value}")
        else:
            applied.append(f"{key}={value} (not applied: cgroup v1)")
    return oom_score_adj, applied

