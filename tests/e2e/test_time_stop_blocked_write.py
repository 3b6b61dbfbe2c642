"""``nri-qos run`` stopped by SIGTERM while a loop's host file blocks (here a FIFO with no writer
where the drift loop reads a process's ``oom_score_adj``, as a write to a memory limit blocks in
reclaim): the process ends within its budget, well inside the time it is given to stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from nri_plugin.cli.daemon import EXIT_WAIT_S
from nri_plugin.sim.simulator import RuntimeSimulator
from reconciler.runner import CLOSE_WAIT_S
from tests.support.builders import LEVEL
from tests.support.fakesys import FakeHost, nri_messages
from tests.support.paths import REPO


def systemd_stop_s() -> float:
    """deploy/nri-qos.service's TimeoutStopSec (seconds), the shorter of the two budgets to stop
    (the DaemonSet's terminationGracePeriodSeconds is 45 s)."""
    unit = (REPO / "deploy" / "nri-qos.service").read_text()
    [value] = [line.split("=", 1)[1] for line in unit.splitlines()
               if line.startswith("TimeoutStopSec=")]
    return float(value)


def config_for(root: Path) -> str:
    """Loops every 0.1 s on the fake host, enforcing; no API, no status socket."""
    return (f'[agent]\nmode = "enforce"\n[reconciler]\nroot = "{root}"\n'
            "drift_interval_s = 0.1\n[memory_guard]\ninterval_s = 0.1\n"
            "[kubernetes]\nenabled = false\n[status]\nenabled = false\n")


def release(fifo: Path) -> None:
    """Lets a reader blocked in opening ``fifo`` go on (it reads end of file)."""
    with contextlib.suppress(OSError):  # no reader left
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


async def test_sigterm_ends_the_agent_in_time_while_a_host_file_blocks(short_dir: Path) -> None:
    budget_s = systemd_stop_s()
    assert budget_s > CLOSE_WAIT_S + EXIT_WAIT_S
    root = short_dir / "host"
    host = FakeHost(root)
    pod = host.add_pod("0a0a0a0a-1111-2222-3333-444444444444", tier="besteffort",
                       annotations={LEVEL: "reclaimed_cores"}, threads=3)
    fifo = root / f"proc/{pod.containers[0].pids[0]}/oom_score_adj"
    fifo.unlink()
    os.mkfifo(fifo)
    config = short_dir / "config.toml"
    config.write_text(config_for(root))
    pod_message, containers = nri_messages(pod)
    simulator = RuntimeSimulator(short_dir / "nri.sock", pods=[pod_message],
                                 containers=containers)
    await simulator.start()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nri_plugin", "run", "--config", str(config),
        "--nri-socket", str(simulator.socket_path), "--log-level", "warning",
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    assert child.stderr is not None
    said = told = b""
    try:
        await asyncio.wait_for(simulator.wait_ready(), 30)
        # Polling: the drift loop's thread opens the FIFO on its own time.
        async with asyncio.timeout(30):
            while not _reader_waits(child.pid):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        reading = asyncio.gather(child.stderr.read(), child.stdout.read())
        status = await asyncio.wait_for(child.wait(), budget_s)
        said, told = await reading
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        release(fifo)
        await simulator.stop()
    assert status == 0, said.decode()[-2000:]
    assert b'"reconciler_loop_close_deferred"' in said
    # Said once the agent's logging is gone, as a failure before it is set up is said.
    assert b"exit_threads_left" in told


def _reader_waits(pid: int) -> bool:
    """Whether a thread of ``pid`` is blocked opening a FIFO (the kernel's wait for the other
    end): a stop is only the case under test once the host file holds the cycle."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "wchan").read_text() == "wait_for_partner":
                return True
    return False
