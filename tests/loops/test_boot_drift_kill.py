"""A drift cycle killed halfway (SIGKILL: an OOM kill of the agent, a stop past its grace
period) leaves a note of every value it wrote in the state file, and the next run gives the
value back once no policy asks for it."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.loops.container_values import NOTES
from reconciler.loops.drift import DriftLoop
from tests.support.fakesys import GIB, MIB, FakeHost

UID = "77777777-0000-0000-0000-000000000007"
KUBELETS = 300


def synced(host: FakeHost) -> NodeState:
    """The runtime's list, with kubelet's score of each container."""
    state = NodeState()
    pods, containers = host.nri()
    state.replace_all(pods, [dataclasses.replace(c, oom_score_adj=KUBELETS) for c in containers])
    return state


def test_a_score_written_just_before_a_kill_goes_back_after_a_restart_with_it_off(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host", version=2)
    host.set_numa([(8 * GIB, 16 * GIB, 100)])
    first = host.add_pod(UID, memory_limit=512 * MIB, memory_request=64 * MIB,
                         annotations={"qos.nri-qos.io/oom-score-adj": "500"})
    container = first.containers[0]
    [second_pid] = host.add_process(container, oom_score_adj=KUBELETS)
    first_score = host.root / "proc" / str(container.pids[0]) / "oom_score_adj"
    first_score.write_text(f"{KUBELETS}\n")
    blocking = host.root / "proc" / str(second_pid) / "oom_score_adj"
    blocking.unlink()
    os.mkfifo(blocking)  # the cycle blocks here, after its write to the first process
    state = synced(host)
    path = tmp_path / "state" / "state.json"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, killed in its cycle
        try:
            sysfs = SysFs(host.root, AuditLog(MemoryAuditSink()))
            loop = DriftLoop(Config, state, sysfs, layout_for(sysfs), 16 * GIB,
                             notes=StateFile(str(path)))
            loop.cycle(10.0)
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while first_score.read_text().strip() != "500" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first_score.read_text().strip() == "500"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert container.info.id in StateFile(str(path)).entries(NOTES)
    # The next run, with the score switched off (a new configuration rolled out).
    blocking.unlink()
    blocking.write_text(f"{KUBELETS}\n")  # the process the killed cycle never reached
    off = dataclasses.replace(Config(), oom=dataclasses.replace(Config().oom, enabled=False))
    sysfs = SysFs(host.root, AuditLog(MemoryAuditSink()))
    DriftLoop(lambda: off, synced(host), sysfs, layout_for(sysfs), 16 * GIB,
              notes=StateFile(str(path))).cycle(20.0)
    assert first_score.read_text().strip() == str(KUBELETS)
