"""A fake host tree with the node files detection reads, its configuration, and the board it
publishes on (the detection tests' setting)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.detection.notified import PressureLevels
from reconciler.detection.publisher import Publisher
from reconciler.detection.service import DetectorsLoop
from reconciler.detection.signals import Board, Level, Reading
from reconciler.host.probe import HostInfo, probe_host
from reconciler.host.sysfs import SysFs
from tests.support.fakesys import GIB, FakeHost

LEVEL = "qos.nri-qos.io/level"


def uid(name: str) -> str:
    """The uid :meth:`Setup.pod` gives the pod ``name``."""
    return f"{name}-0000-4000-8000-000000000000"


def pod_pressure(total: int = 0) -> str:
    """A cgroup's ``memory.pressure``: ``total`` microseconds some task stalled, none all."""
    return (f"some avg10=0 avg60=0 avg300=0 total={total}\n"
            "full avg10=0 avg60=0 avg300=0 total=0\n")


class Setup:
    def __init__(self, root: Path, version: int = 1, *, refaults: bool = False,
                 **detection: Any) -> None:
        """``refaults``: the kernel's memory.stat counts working-set refaults."""
        self.host = FakeHost(root, version=version,
                             driver="systemd" if version == 2 else "cgroupfs")
        self._refaults = refaults
        if refaults:
            self.refaults(self.host.tier_dir("guaranteed"), 0)
        self.host.set_numa([(40 * GIB, 64 * GIB, 1000), (40 * GIB, 64 * GIB, 1000)])
        self.vmstat(0)
        self.pressure(0, 0)
        cfg = Config()
        self.cfg = dataclasses.replace(cfg, detection=dataclasses.replace(cfg.detection,
                                                                          **detection))
        self.sink = MemoryAuditSink()
        self.sysfs = SysFs(root, AuditLog(self.sink))
        self.state = NodeState()
        self.board = Board()
        self.publisher = Publisher(self.board, AuditLog(self.sink), lambda: self.cfg.detection)

    def vmstat(self, steal: int) -> None:
        (self.host.root / "proc/vmstat").write_text(
            f"nr_free_pages 5\npgsteal_kswapd {steal}\npgscan_kswapd {steal * 2}\n")

    def pressure(self, some: int, full: int) -> None:
        """Replaced at once, as the kernel's file changes: a reader never sees half of it."""
        path = self.host.root / "proc/pressure/memory"
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".new")
        tmp.write_text(f"some avg10=0.00 avg60=0.00 avg300=0.00 total={some}\n"
                       f"full avg10=0.00 avg60=0.00 avg300=0.00 total={full}\n")
        os.replace(tmp, path)

    async def stall(self, until: asyncio.Event) -> None:
        """The node's stall counters grow by 20 ms every 10 ms (far above any threshold) until
        ``until`` is set."""
        total = 0
        while not until.is_set():
            total += 20_000
            self.pressure(total, total)
            await asyncio.sleep(0.01)

    def pod(self, name: str, level: str, *, request: int, anon: int, tier: str = "besteffort",
            annotations: dict[str, str] | None = None) -> Path:
        self.host.add_pod(uid(name), tier=tier, name=name, memory_request=request,
                          annotations={LEVEL: level, **(annotations or {})})
        d = self.host.cg("memory", self.host.pod_rel(tier, uid(name)))
        v2 = self.host.version == 2
        (d / "memory.stat").write_text(f"anon {anon}\nfile {GIB}\n" if v2 else
                                       f"cache 0\nrss 0\ntotal_cache {GIB}\ntotal_rss {anon}\n")
        if self._refaults:
            self.refaults(d, 0)
        self.state.replace_all(*self.host.nri())
        return d

    def refaults(self, cgroup: Path, pages: int) -> None:
        """The cgroup's ``memory.stat`` as the kernel shapes it, with ``pages`` refaulted (file
        pages, and one anonymous page in ten)."""
        anon = pages // 10
        if self.host.version == 2:
            text = (f"anon {GIB}\nfile {GIB}\nworkingset_refault_anon {anon}\n"
                    f"workingset_refault_file {pages - anon}\n")
        else:
            text = (f"cache 0\nrss 0\nworkingset_refault_anon 0\nworkingset_refault_file 0\n"
                    f"total_cache {GIB}\ntotal_rss {GIB}\ntotal_workingset_refault_anon {anon}\n"
                    f"total_workingset_refault_file {pages - anon}\n")
        (cgroup / "memory.stat").write_text(text)

    def host_info(self) -> HostInfo:
        return probe_host(self.sysfs)

    def memcg_events(self) -> PressureLevels:
        """cgroup v1 pressure notifications on the fake tree: the root memcg and kubelet's tier
        cgroups get ``memory.pressure_level`` and ``cgroup.event_control`` as plain files, so a
        registration is taken and never signalled (the test signals it)."""
        for rel in ("", "kubepods", "kubepods/burstable"):
            d = self.host.cg("memory", rel)
            (d / "memory.pressure_level").write_text("")
            (d / "cgroup.event_control").write_text("")
        info = self.host_info()
        assert info.memcg.pressure_level
        return PressureLevels(lambda: self.cfg, self.publisher, self.sysfs, info)

    def loop(self) -> DetectorsLoop:
        return DetectorsLoop(lambda: self.cfg, self.publisher, self.state, self.sysfs,
                             self.host_info())

    def reading(self, detector: str, scope: str) -> Reading | None:
        return next((r for r in self.board.current() if r.key == (detector, scope)), None)

    def level(self, detector: str, scope: str) -> Level | None:
        found = self.reading(detector, scope)
        return None if found is None else found.level
