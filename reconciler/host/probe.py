"""What this host offers, probed once at start and handed to every component that needs it.

The NRI capabilities (cgroup version for memory QoS, memory size, resctrl) and the reconciler's
loops (cgroup layout, NUMA nodes, memcg knobs, PSI) receive the same :class:`HostInfo`, so they can
never disagree about the host; ``nri-qos probe`` prints it. Nothing here raises for a missing
feature: each absence is recorded with the reason, for the feature that needs it to say why it
is off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from hooks.resctrl import ResctrlInfo
from reconciler.host.cgroups import BESTEFFORT, CGROUP_MOUNT, CgroupLayout, layout_for
from reconciler.host.memstat import refault_pages
from reconciler.host.numa import (
    NumaFormatError,
    NumaNode,
    NumaView,
    check_view,
    node_ids,
    read_meminfo,
    read_nodes,
)
from reconciler.host.parse import ParseError, errno_text, parse_counters
from reconciler.host.resctrl_files import ResctrlUnavailable
from reconciler.host.resctrlfs import read_info
from reconciler.host.sysfs import SysFs
from reconciler.host.values import PAGE_SIZE

KERNEL_RELEASE = "/proc/sys/kernel/osrelease"
PSI_MEMORY = "/proc/pressure/memory"
ZSWAP_ENABLED = "/sys/module/zswap/parameters/enabled"
TRIGGER_WINDOWS_US = (500_000, 1_000_000, 2_000_000)
"""Trigger windows tried, shortest first: the kernel takes 500 ms to 10 s, and without
CAP_SYS_RESOURCE some kernels only whole multiples of 2 s on cgroup pressure files."""


@dataclass(frozen=True, slots=True)
class MemcgKnobs:
    """Memory-cgroup files found in one cgroup of the memory hierarchy."""

    # The cgroup examined (a system path): kubelet's pods cgroup when there is one.
    where: str
    reclaim: bool = False  # v2 memory.reclaim: proactive reclaim of a given amount
    high: bool = False  # v2 memory.high: throttling limit
    wmark_ratio: bool = False  # memory.wmark_ratio (veLinux/Anolis): async reclaim watermark
    force_empty: bool = False  # v1 memory.force_empty: reclaim everything reclaimable
    pressure_level: bool = False  # v1 memory.pressure_level: eventfd notifications
    numa_stat: bool = False  # memory.numa_stat: usage per NUMA node
    refaults: bool = False  # memory.stat counts working-set refaults (v1: Linux 5.9+ or so)
    # v1: why memory.pressure_level notifications cannot be had ("" when they can).
    pressure_level_problem: str = ""


@dataclass(frozen=True, slots=True)
class TriggerSupport:
    """Whether a PSI trigger can be armed on a pressure file, and with which window."""

    path: str
    # The shortest window (µs) the kernel accepted; None when it accepted none.
    window_us: int | None
    # Why not ("" when accepted).
    problem: str
    # The cgroup was not there to probe (kubelet not started yet): probed again once it is.
    pending: bool = False


@dataclass(frozen=True, slots=True)
class PsiSupport:
    readable: bool
    system: TriggerSupport
    # On the memory.pressure file of kubelet's pods cgroup (cgroup v2 only), else None.
    cgroup: TriggerSupport | None
    # cgroup v2 cgroups have pressure files of their own: not where PSI is on for the node
    # only (``cgroup_disable=pressure``).
    cgroups: bool = False


@dataclass(frozen=True, slots=True)
class HostInfo:
    root: str
    kernel: str
    cgroup: CgroupLayout
    # /proc/meminfo MemTotal: what node-wide limits use (0 when unreadable).
    meminfo_total_bytes: int
    numa_nodes: tuple[NumaNode, ...]
    numa_view: NumaView
    resctrl: ResctrlInfo | None
    # Why resctrl is unusable ("" when usable or not asked for).
    resctrl_problem: str
    memcg: MemcgKnobs
    psi: PsiSupport
    warnings: tuple[str, ...]
    # /proc/meminfo SwapTotal: 0 when the node has no swap (anonymous memory cannot be
    # reclaimed then, only file cache).
    swap_total_bytes: int = 0
    # zswap is on (it compresses into RAM what is swapped out; it needs a swap device too).
    zswap: bool = False
    # The BestEffort tier's cgroup has cpu.idle (Linux 5.15+, the cpu controller there).
    cpu_idle: bool = False
    # sysfs lists NUMA nodes (a kernel without NUMA has none: ``numa_nodes`` is then the
    # machine as one node 0, from /proc/meminfo).
    numa_sysfs: bool = False

    @property
    def memory_total_bytes(self) -> int:
        """The machine's memory for node-wide limits: /proc/meminfo, never the per-node sum
        (which misses hot-added memory), unless /proc/meminfo is unreadable."""
        return self.meminfo_total_bytes or self.numa_view.nodes_total_bytes

    @property
    def pod_psi(self) -> bool:
        """Each cgroup has its own memory.pressure: cgroup v2 with PSI on, cgroups' too."""
        return self.cgroup.v2 and self.psi.readable and self.psi.cgroups

    @property
    def pod_refaults(self) -> bool:
        """Each online pod's working-set refaults are read as its own sign of pressure: where
        its PSI is not (cgroup v1), since a pod's PSI already counts its stalls on refaults."""
        return self.memcg.refaults and not self.pod_psi


def reaches_host(sysfs: SysFs) -> bool:
    """Whether the tree's root shows a host: its cgroups and its procfs below it."""
    return sysfs.is_dir("/sys/fs/cgroup") and sysfs.is_dir("/proc")


def probe_host(sysfs: SysFs, *, cgroup_version: str = "auto", cgroup_driver: str = "auto",
               resctrl_mount: str | None = None, amd_mb_max: int = 2048,
               numa_tolerance_percent: float = 10.0) -> HostInfo:
    """Probe everything once. ``resctrl_mount`` None: resctrl is not wanted (not probed)."""
    warnings: list[str] = []
    if not reaches_host(sysfs):
        # Else every finding below reads as the host's: no cgroups, no memory, kernel unknown.
        warnings.append(f"[reconciler] root {sysfs.root} does not reach the host: no "
                        "sys/fs/cgroup or proc below it (in a pod, the host's /sys/fs and /proc "
                        "are mounted there); what follows is not this host's")
    layout = layout_for(sysfs, cgroup_version, cgroup_driver)
    meminfo = read_meminfo(sysfs)
    try:
        nodes = tuple(read_nodes(sysfs, PAGE_SIZE))
    except NumaFormatError as exc:
        # Not a reason to refuse to start: the loops that read the nodes report their own
        # failures (reconciler_loop_failed, retried with backoff).
        nodes = ()
        warnings.append(f"the NUMA nodes' memory is unreadable ({exc})")
    view = check_view(nodes, meminfo.get("MemTotal", 0), numa_tolerance_percent)
    if not meminfo:
        warnings.append("/proc/meminfo is unreadable: node-wide limits use the NUMA nodes' sum")
    elif not view.consistent:
        warnings.append(view.describe() + "; node-wide limits use /proc/meminfo")
    memcg = _memcg_knobs(sysfs, layout)
    resctrl: ResctrlInfo | None = None
    resctrl_problem = ""
    if resctrl_mount is not None:
        try:
            resctrl = read_info(sysfs, resctrl_mount, amd_mb_max)
        except ResctrlUnavailable as exc:
            resctrl_problem = str(exc)
    kernel = (sysfs.read(KERNEL_RELEASE) or "").strip() or "unknown"
    return HostInfo(
        root=str(sysfs.root), kernel=kernel, cgroup=layout,
        meminfo_total_bytes=meminfo.get("MemTotal", 0), numa_nodes=nodes, numa_view=view,
        resctrl=resctrl, resctrl_problem=resctrl_problem, memcg=memcg,
        psi=_psi(sysfs, layout, memcg.where), warnings=tuple(warnings),
        swap_total_bytes=meminfo.get("SwapTotal", 0),
        zswap=(sysfs.read(ZSWAP_ENABLED) or "").strip() in ("Y", "1"),
        cpu_idle=sysfs.exists(f"{layout.tier_dir('cpu', BESTEFFORT)}/cpu.idle"),
        numa_sysfs=bool(node_ids(sysfs)),
    )


def _probe_cgroup(sysfs: SysFs, layout: CgroupLayout) -> str:
    """Where memcg files are looked for: kubelet's pods cgroup, else any child cgroup of the
    memory hierarchy (the root lacks most files), else the root."""
    pods = layout.tier_dir("memory", "guaranteed")
    if sysfs.is_dir(pods):
        return pods
    root = layout.dir("memory", "")
    children = sysfs.list_subdirs(root)
    return f"{root}/{children[0]}" if children else root


def _memcg_knobs(sysfs: SysFs, layout: CgroupLayout) -> MemcgKnobs:
    where = _probe_cgroup(sysfs, layout)

    def has(name: str) -> bool:
        return sysfs.exists(f"{where}/{name}")

    refaults = _counts_refaults(sysfs.read(f"{where}/memory.stat"), layout.v2)
    if layout.v2:
        return MemcgKnobs(where, reclaim=has("memory.reclaim"), high=has("memory.high"),
                          wmark_ratio=has("memory.wmark_ratio"), numa_stat=has("memory.numa_stat"),
                          refaults=refaults)
    level_problem = _pressure_level_problem(sysfs, f"{CGROUP_MOUNT}/memory")
    return MemcgKnobs(where, wmark_ratio=has("memory.wmark_ratio"),
                      force_empty=has("memory.force_empty"), pressure_level=not level_problem,
                      numa_stat=has("memory.numa_stat"), refaults=refaults,
                      pressure_level_problem=level_problem)


def _pressure_level_problem(sysfs: SysFs, root: str) -> str:
    """"" when the root memcg takes a ``memory.pressure_level`` registration (made and at once
    dropped), else why not: a file that is there but whose registration is refused would leave
    the ladder waiting for events that never come."""
    if not sysfs.exists(f"{root}/memory.pressure_level"):
        return "the memory controller has no memory.pressure_level"
    try:
        os.close(sysfs.register_memcg_event(root, "memory.pressure_level", "low"))
    except OSError as exc:
        return ("cgroup.event_control refuses memory.pressure_level registrations "
                f"({errno_text(exc)})")
    return ""


def _counts_refaults(stat: str | None, v2: bool) -> bool:
    try:
        return stat is not None and refault_pages(parse_counters(stat), v2) is not None
    except ParseError:
        return False


def _psi(sysfs: SysFs, layout: CgroupLayout, where: str) -> PsiSupport:
    """``where``: a cgroup of the memory hierarchy (:func:`_probe_cgroup`)."""
    why = "PSI is not available (kernel without CONFIG_PSI, or psi=0)"
    try:
        readable = sysfs.read(PSI_MEMORY) is not None
    except OSError as exc:
        # A kernel booted with psi=0 may keep the file and refuse every read (EOPNOTSUPP).
        readable = False
        why = f"PSI is off: reading {PSI_MEMORY} fails ({errno_text(exc)}; psi=0?)"
    system = trigger_support(sysfs, PSI_MEMORY) if readable else TriggerSupport(
        PSI_MEMORY, None, why)
    cgroup = cgroup_trigger_support(sysfs, layout) if layout.v2 else None
    # The root's file, else the examined cgroup's (the root has none before Linux 5.2).
    cgroups = layout.v2 and any(sysfs.exists(f"{d}/memory.pressure")
                                for d in (layout.dir("memory", ""), where))
    return PsiSupport(readable, system, cgroup, cgroups)


class Armed(Protocol):
    def close(self) -> None: ...


Arm = Callable[[str, int, int], Armed]
"""Arm a trigger on a pressure file: ``(path, stall_us, window_us)``; raises OSError when
refused."""


def cgroup_trigger_support(sysfs: SysFs, layout: CgroupLayout,
                           arm: Arm | None = None) -> TriggerSupport:
    """Triggers on the ``memory.pressure`` of kubelet's pods cgroup (cgroup v2). Before kubelet
    has made that cgroup (the agent started first, as at a node's boot) there is nothing to
    arm one on: the answer is ``pending``, for its user to ask again once the cgroup is
    there."""
    pods = layout.tier_dir("memory", "guaranteed")
    path = f"{pods}/memory.pressure"
    if sysfs.exists(path):
        return trigger_support(sysfs, path, arm)
    if not sysfs.is_dir(pods):
        return TriggerSupport(path, None, "kubelet's pods cgroup is not there yet", pending=True)
    return TriggerSupport(path, None, "no memory.pressure file")


def trigger_support(sysfs: SysFs, path: str, arm: Arm | None = None) -> TriggerSupport:
    """Arm and at once disarm a trigger of each window in :data:`TRIGGER_WINDOWS_US`; through
    ``arm`` when given, else on the pressure file."""
    problem = ""
    for window in TRIGGER_WINDOWS_US:
        try:
            if arm is not None:
                arm(path, window // 10, window).close()
            else:
                os.close(sysfs.open_trigger(path, f"some {window // 10} {window}"))
        except OSError as exc:
            problem = errno_text(exc)
            continue
        return TriggerSupport(path, window, "")
    return TriggerSupport(path, None, f"the kernel refused every window tried ({problem})")

