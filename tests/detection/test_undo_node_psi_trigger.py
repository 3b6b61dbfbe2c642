"""The node's PSI trigger is registered with this machine's kernel only while the psi detector
runs: switched off by a reload, the trigger is closed (the kernel forgets it with its
descriptor), as the online pods' triggers and the memcg pressure events are; switched on again,
it is armed anew."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.detection import sections
from reconciler.detection.notified import NodePsi
from reconciler.detection.publisher import Publisher
from reconciler.detection.signals import Board
from reconciler.host import pressure
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from tests.support.polling import eventually
from tests.support.realroot import MIB, RealRoot, unavailable

pytestmark = [pytest.mark.real_kernel,
              pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "available")]

PSI_MEMORY = "/proc/pressure/memory"


def triggers_open() -> int:
    """This process's descriptors on the node's memory pressure file (each one a trigger)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == PSI_MEMORY
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
    return count


def with_psi(cfg: Config, enabled: bool) -> Config:
    return dataclasses.replace(cfg, detection=dataclasses.replace(cfg.detection,
                                                                  enabled=enabled))


async def test_switched_off_the_nodes_trigger_is_closed_and_switched_on_armed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The looks of a quiet trigger and of a path switched off, at test speed.
    monkeypatch.setattr(pressure, "QUIET_TRIGGER_RECHECK_S", 0.05)
    monkeypatch.setattr(sections, "SWITCHED_OFF_RECHECK_S", 0.05)
    with RealRoot(tmp_path, "psi-undo", 64 * MIB) as root:
        audit = AuditLog(MemoryAuditSink())
        sysfs = SysFs(root.root, audit)
        host = probe_host(sysfs)
        window = host.psi.system.window_us
        if not host.psi.readable or window is None or window > 10_000_000:
            pytest.skip(f"no PSI trigger on this kernel ({host.psi.system.problem})")
        cfg = Config()
        cfg = dataclasses.replace(cfg, detection=dataclasses.replace(
            cfg.detection, interval_s=0.1, psi_trigger_window_ms=window // 1000))
        config = [cfg]
        publisher = Publisher(Board(), audit, lambda: config[0].detection)
        psi = NodePsi(lambda: config[0], publisher, sysfs, host)
        before = triggers_open()
        stop = asyncio.Event()
        task = asyncio.create_task(psi.run(stop))
        try:
            await eventually(lambda: triggers_open() == before + 1)
            assert psi.mode == "trigger"
            config[0] = with_psi(cfg, enabled=False)
            await eventually(lambda: triggers_open() == before)
            await asyncio.sleep(0.3)  # several looks while off: none arms it again
            assert triggers_open() == before
            config[0] = cfg
            await eventually(lambda: triggers_open() == before + 1)
            assert psi.mode == "trigger"
        finally:
            stop.set()
            await asyncio.wait_for(task, 5.0)
        assert triggers_open() == before
