"""A drift loop over a fake host's tree, cycled as its timer would: each cycle ten seconds after
the last."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from common.audit import AuditLog
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.numa import read_meminfo
from reconciler.host.sysfs import SysFs
from reconciler.loops.drift import DriftLoop


class Drift:
    """Drift over ``root`` with the layout and memory size found there; with ``observe``, its
    writes are held back while ``observe()`` is true."""

    def __init__(self, root: Path, state: NodeState, config: Callable[[], Config],
                 audit: AuditLog, observe: Callable[[], bool] | None = None) -> None:
        sysfs = SysFs(root, audit)
        if observe is not None:
            sysfs = sysfs.observing(observe)
        self.loop = DriftLoop(config, state, sysfs, layout_for(sysfs),
                              read_meminfo(sysfs).get("MemTotal", 0))
        self.now = 0.0

    def cycle(self) -> None:
        self.now += 10.0
        self.loop.cycle(self.now)
