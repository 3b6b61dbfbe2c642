"""The agent's threads under ``SCHED_BATCH`` (``[agent] scheduling``), on this machine's kernel:
a running agent's every thread, the policy a thread's children inherit, a refusal."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from pathlib import Path

import pytest

from nri_plugin.scheduling import BATCH, NORMAL, set_scheduling
from nri_plugin.sim.simulator import RuntimeSimulator
from tests.support.paths import REPO
from tests.support.polling import eventually

KERNEL_POLICY = {BATCH: os.SCHED_BATCH, NORMAL: os.SCHED_OTHER}


def thread_policies(pid: int) -> dict[int, int]:
    return {int(tid): os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.parametrize("policy", [BATCH, NORMAL])
async def test_every_thread_of_a_running_agent_is_under_its_policy(tmp_path: Path,
                                                                  policy: str) -> None:
    config = tmp_path / "config.toml"
    # No [agent] table for normal: the default is what is tested.
    config.write_text(("" if policy == NORMAL else '[agent]\nscheduling = "batch"\n')
                      + f'[status]\nsocket = "{tmp_path / "status.sock"}"\n'
                      "[kubernetes]\nenabled = false\n[resctrl]\nenabled = false\n"
                      f'[reconciler]\nstate_dir = "{tmp_path / "state"}"\n'
                      # kubelet's cgroup driver, which a machine without kubelet cannot show
                      'cgroup_driver = "cgroupfs"\n')
    simulator = RuntimeSimulator(tmp_path / "nri.sock")
    await simulator.start()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nri_plugin", "run", "--config", str(config),
        "--socket", str(tmp_path / "nri.sock"), "--log-level", "info", cwd=REPO,
        stderr=asyncio.subprocess.PIPE)
    try:
        await simulator.wait_ready(timeout_s=30)
        # The reconciler's loops and the capabilities run on pools of threads, started once
        # the agent is registered: wait for them.
        await eventually(lambda: len(thread_policies(child.pid)) >= 3, timeout_s=30)
        policies = thread_policies(child.pid)
        assert set(policies.values()) == {KERNEL_POLICY[policy]}, policies
    finally:
        child.terminate()
        _, err = await child.communicate()
        await simulator.stop()
    records = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    assert {"event": "scheduling_set", "policy": policy} in [
        {key: record.get(key) for key in ("event", "policy")} for record in records]


def test_a_thread_started_after_the_policy_inherits_it() -> None:
    seen: dict[str, int | OSError | None] = {}
    # Whatever an agent served in this process earlier left on it.
    own = os.sched_getscheduler(0)

    def child() -> None:
        seen["child"] = os.sched_getscheduler(0)

    def parent() -> None:
        seen["refused"] = set_scheduling(BATCH)
        seen["parent"] = os.sched_getscheduler(0)
        started = threading.Thread(target=child)
        started.start()
        started.join()
        # Back to the default: no privilege is needed either way.
        seen["back"] = set_scheduling(NORMAL)
        seen["after"] = os.sched_getscheduler(0)

    # On a thread of its own: the policy is per thread, and this thread's stays as it is.
    thread = threading.Thread(target=parent)
    thread.start()
    thread.join()
    assert seen == {"refused": None, "parent": os.SCHED_BATCH, "child": os.SCHED_BATCH,
                    "back": None, "after": os.SCHED_OTHER}
    assert os.sched_getscheduler(0) == own


def test_a_refusal_is_returned_not_raised() -> None:
    calls: list[tuple[int, int, int]] = []

    def refuse(pid: int, policy: int, param: os.sched_param) -> None:
        calls.append((pid, policy, param.sched_priority))
        raise PermissionError(1, "Operation not permitted")

    refused = set_scheduling(BATCH, setter=refuse)
    assert isinstance(refused, PermissionError)
    assert calls == [(0, os.SCHED_BATCH, 0)]
