"""A move of task ids that the kernel refuses at every cycle (EINVAL, ENOSPC ...) is said once
while it lasts, and said again after a move into that group has landed; the other groups' moves
land meanwhile."""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Iterable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.levels import LEVEL_NAMES
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.resctrlfs import ResctrlFs, read_info
from reconciler.host.sysfs import SysFs
from reconciler.loops.resctrl_tasks import ResctrlTasksLoop
from tests.support.fakesys import FakeHost, read_ids

PREFIX = "nriqos-"


def test_a_move_refused_every_cycle_is_said_once_while_it_lasts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = FakeHost(tmp_path)
    root = host.make_resctrl()
    for level in LEVEL_NAMES:
        host.add_resctrl_group(PREFIX + level)
    cfg = Config()
    cfg = dataclasses.replace(cfg, reconciler=dataclasses.replace(cfg.reconciler,
                                                                  full_scan_every=1))
    audit = AuditLog(MemoryAuditSink())
    sysfs = SysFs(tmp_path, audit)
    mount = "/" + str(root.relative_to(tmp_path))
    fs = ResctrlFs(sysfs, mount, read_info(sysfs, mount, 2048), prefix=PREFIX, audit=audit)
    state = NodeState()
    loop = ResctrlTasksLoop(lambda: cfg, state, sysfs, layout_for(sysfs), fs, audit)
    refused = host.add_pod("00000001-0000-4000-8000-000000000000", tier="besteffort")
    placed = host.add_pod("00000002-0000-4000-8000-000000000000", tier="burstable")
    state.replace_all(*host.nri())
    tasks = root / f"{PREFIX}reclaimed_cores" / "tasks"
    add_tasks = ResctrlFs.add_tasks

    def refusing(self: ResctrlFs, group: str, tids: Iterable[int], *,
                 monitor: bool = False) -> int:
        if group == f"{PREFIX}reclaimed_cores":
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return add_tasks(self, group, tids, monitor=monitor)

    monkeypatch.setattr(ResctrlFs, "add_tasks", refusing)
    with capture_logs() as logs:
        for t in range(5):
            loop.cycle(float(t))
        assert len([e for e in logs if e["event"] == "resctrl_task_move_failed"]) == 1
        monkeypatch.undo()
        loop.cycle(5.0)
        assert set(refused.containers[0].tids) <= set(read_ids(tasks))
        monkeypatch.setattr(ResctrlFs, "add_tasks", refusing)
        host.add_process(refused.containers[0])
        loop.cycle(6.0)
    assert len([e for e in logs if e["event"] == "resctrl_task_move_failed"]) == 2
    assert set(placed.containers[0].tids) <= set(read_ids(root / f"{PREFIX}shared_cores"
                                                          / "tasks"))
