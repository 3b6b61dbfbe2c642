"""Per-NUMA-node free memory and low watermark, from sysfs node meminfo and /proc/zoneinfo.

* ``/sys/devices/system/node/node<N>/meminfo``: lines ``Node <N> MemFree:   <n> kB``.
* ``/proc/zoneinfo``: a block per zone, headed ``Node <N>, zone <Name>``, with lines
  ``pages free <n>``, ``min <n>``, ``low <n>``, ``high <n>`` counted in pages. The kernel keeps
  watermarks per zone; a node's low watermark is the sum over its zones.

A kernel built without NUMA has no ``node*`` directories: the host is then one node 0 whose free
memory comes from ``/proc/meminfo`` (``MemFree:``).

A node of memory alone (in ``has_memory``, not in ``has_cpu``: a CXL expander, HBM in flat mode, a
GPU's memory onlined as a node) is not like the others: the kernel demotes cold pages into far
memory, so one under its watermark is its normal state, and HBM or a GPU's memory is not the
offline tier's to fill. :func:`memory_only` names them and :func:`local_nodes` leaves them out of
what the agent places memory on and counts as room.

The per-node figures do not always add up to the machine: memory hot-added to a VM is online but
missing from the nodes' ``meminfo`` (seen: 3.7 GB in node 0 of a 24.7 GB VM), and ballooning
makes similar gaps. :func:`check_view` compares the nodes' sum with ``/proc/meminfo``; when they
disagree by more than a tolerance, node-wide figures come from ``/proc/meminfo``
(:func:`system_node`) and the per-node ones serve only per-node decisions.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from hooks.untrusted import bounded_repr
from reconciler.host.sysfs import SysFs
from reconciler.host.values import parse_id_list

NODE_DIR = "/sys/devices/system/node"
ZONEINFO = "/proc/zoneinfo"
MEMINFO = "/proc/meminfo"
VMSTAT = "/proc/vmstat"
HAS_CPU = f"{NODE_DIR}/has_cpu"
HAS_MEMORY = f"{NODE_DIR}/has_memory"
WATERMARK_SCALE_FACTOR = "/proc/sys/vm/watermark_scale_factor"

_NODE_NAME = re.compile(r"node(\d+)")
ZONE_HEADER = re.compile(r"Node\s+(\d+),\s+zone\s+(\S+)")
"""The line that opens a zone's block in ``/proc/zoneinfo``: its node and zone name."""


def zone_blocks(text: str) -> Iterator[tuple[str, str]]:
    """Each zone of ``/proc/zoneinfo``: its header line and the part of its block worth reading,
    from its ``pages free`` line (or the top) to its ``pagesets`` (or the end).

    What is cut off is the per-node counters and every CPU's pageset, which make a zone of a
    96-CPU node about 700 lines; the cuts are found with ``str`` methods, so the lines read do
    not grow with the CPUs (``bench/zoneinfo_parse.py``). Lines before the first header are not a
    zone's."""
    for piece in ("\n" + text).split("\nNode ")[1:]:
        header, _, block = piece.partition("\n")
        start = max(block.find("  pages free"), 0)
        end = block.find("\n  pagesets", start)
        yield "Node " + header, block[start:] if end < 0 else block[start:end]


class NumaFormatError(ValueError):
    """A meminfo or zoneinfo file that does not parse."""


@dataclass(frozen=True, slots=True)
class NumaNode:
    id: int
    free_bytes: int
    total_bytes: int
    low_watermark_bytes: int
    memory_only: bool = False
    """Memory with no CPU (:func:`memory_only`): far memory, HBM or a GPU's."""

    def watermark(self, floor_bytes: int, scale_factor: float,
                  floor_percent: float | None = None) -> int:
        """Memory kept free on this node for online pods: max(floor, low watermark x factor),
        the floor at most ``floor_percent`` of the node's memory when given (a fixed floor as
        large as a small node would leave nothing above it)."""
        floor = floor_bytes if floor_percent is None else min(
            floor_bytes, int(self.total_bytes * floor_percent / 100))
        return max(floor, int(self.low_watermark_bytes * scale_factor))

    def headroom(self, floor_bytes: int, scale_factor: float,
                 floor_percent: float | None = None) -> int:
        """Free memory above the watermark; negative when the node is under it."""
        return self.free_bytes - self.watermark(floor_bytes, scale_factor, floor_percent)


def parse_meminfo(text: str) -> dict[str, int]:
    """``MemFree`` etc. in bytes, from either /proc/meminfo or a node's meminfo."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "Node":  # "Node 0 MemFree: 123 kB"
            words = words[2:]
        if len(words) < 2 or not words[0].endswith(":"):
            raise NumaFormatError(f"meminfo line not understood: {bounded_repr(line)}")
        try:
            number = int(words[1])
        except ValueError as exc:
            raise NumaFormatError(f"meminfo line not understood: {bounded_repr(line)}") from exc
        scale = 1024 if len(words) > 2 and words[2] == "kB" else 1
        values[words[0][:-1]] = number * scale
    return values


def read_meminfo(sysfs: SysFs) -> dict[str, int]:
    """``/proc/meminfo`` in bytes; empty when it is missing or does not parse."""
    return meminfo_values(sysfs.read(MEMINFO))


def meminfo_values(text: str | None) -> dict[str, int]:
    """The text of ``/proc/meminfo`` in bytes; empty when it is None or does not parse."""
    try:
        return parse_meminfo(text) if text else {}
    except NumaFormatError:
        return {}


@dataclass(frozen=True, slots=True)
class NumaView:
    """Whether the per-node memory totals add up to the system's, within a tolerance."""

    system_total_bytes: int
    nodes_total_bytes: int
    tolerance_percent: float

    @property
    def consistent(self) -> bool:
        if self.system_total_bytes <= 0 or self.nodes_total_bytes <= 0:
            return self.nodes_total_bytes == self.system_total_bytes
        gap = abs(self.system_total_bytes - self.nodes_total_bytes)
        return gap * 100 <= self.tolerance_percent * self.system_total_bytes

    def describe(self) -> str:
        return (f"NUMA nodes' MemTotal adds up to {self.nodes_total_bytes} bytes but "
                f"/proc/meminfo says {self.system_total_bytes} bytes (tolerance "
                f"{self.tolerance_percent:g} %)")


def check_view(nodes: Sequence[NumaNode], system_total: int, tolerance_percent: float) -> NumaView:
    return NumaView(system_total, sum(n.total_bytes for n in nodes), tolerance_percent)


def system_node(meminfo: Mapping[str, int], nodes: Sequence[NumaNode]) -> NumaNode:
    """The machine's local memory as one node, from ``/proc/meminfo``: for node-wide limits when
    the per-node view does not add up. The nodes :func:`local_nodes` leaves out are taken off
    its free and total memory, and its low watermark is the sum of the local nodes' zones'."""
    local = local_nodes(nodes)
    others = [n for n in nodes if n not in local]
    return NumaNode(-1, max(meminfo.get("MemFree", 0) - sum(n.free_bytes for n in others), 0),
                    max(meminfo.get("MemTotal", 0) - sum(n.total_bytes for n in others), 0),
                    sum(n.low_watermark_bytes for n in local))


def memory_only(sysfs: SysFs) -> frozenset[int]:
    """The nodes with memory and no CPU (``has_memory`` less ``has_cpu``). None when either file
    is missing (a kernel without NUMA) or not a node list, or when no node has both CPUs and
    memory (some virtual machines are made so): every node then counts as local."""
    has_cpu, has_memory = sysfs.read(HAS_CPU), sysfs.read(HAS_MEMORY)
    if has_cpu is None or has_memory is None:
        return frozenset()
    try:
        memory, cpus = parse_id_list(has_memory), parse_id_list(has_cpu)
    except ValueError:
        return frozenset()
    return memory - cpus if memory & cpus else frozenset()


def local_nodes(nodes: Sequence[NumaNode]) -> list[NumaNode]:
    """The nodes whose memory the agent places the offline tier on and counts as its room: those
    with CPUs and memory. Where none has both (memory only on nodes without CPUs, as some
    virtual machines are made), the nodes with memory; failing that, all of them."""
    with_memory = [n for n in nodes if n.total_bytes > 0]
    return [n for n in with_memory if not n.memory_only] or with_memory or list(nodes)


@dataclass(frozen=True, slots=True)
class Zone:
    node: int
    name: str
    free_pages: int
    min_pages: int
    low_pages: int
    high_pages: int


def parse_zoneinfo(text: str) -> list[Zone]:
    """Every zone with its free pages and watermarks. The kernel writes all four for every zone,
    populated or not, so a zone without one is an error, as is a file without zones."""
    zones: list[Zone] = []
    for header_line, block in zone_blocks(text):
        match = ZONE_HEADER.match(header_line)
        if not match:
            raise NumaFormatError(f"zoneinfo line not understood: {bounded_repr(header_line)}")
        node, name = int(match.group(1)), match.group(2)
        values: dict[str, int] = {}
        for line in block.splitlines():
            words = line.split()
            if words[:2] == ["pages", "free"] and len(words) == 3:
                key, raw = "free", words[2]
            elif len(words) == 2 and words[0] in ("min", "low", "high"):
                key, raw = words
            else:
                continue
            if key in values:
                continue  # the first occurrence inside the zone block is the watermark line
            if not raw.isdigit():
                raise NumaFormatError(f"zoneinfo line not understood: {bounded_repr(line)}")
            values[key] = int(raw)
        missing = [k for k in ("free", "min", "low", "high") if k not in values]
        if missing:
            raise NumaFormatError(f"zone {name} of node {node} lacks {', '.join(missing)}")
        zones.append(Zone(node, name, values["free"], values["min"], values["low"],
                          values["high"]))
    if not zones:
        raise NumaFormatError("no zones" if text.strip() else "empty zoneinfo")
    return zones


def node_lows(zones: Sequence[Zone], page_size: int) -> dict[int, int]:
    """Low watermark per node in bytes: the sum of the ``low`` pages of the node's zones."""
    lows: dict[int, int] = {}
    for zone in zones:
        lows[zone.node] = lows.get(zone.node, 0) + zone.low_pages * page_size
    return lows


def node_ids(sysfs: SysFs) -> list[int]:
    ids = [int(m.group(1)) for name in sysfs.list_dir(NODE_DIR)
           if (m := _NODE_NAME.fullmatch(name))]
    return sorted(ids)


def read_nodes(sysfs: SysFs, page_size: int, meminfo: str | None = None,
               ids: Sequence[int] | None = None,
               lows: Mapping[int, int] | None = None,
               far: frozenset[int] | None = None) -> list[NumaNode]:
    """Every NUMA node of the host (one node 0 on a kernel without NUMA); empty if unreadable.
    ``meminfo``: the text of ``/proc/meminfo`` when the caller has read it (None: read here
    if needed); ``ids``: the nodes :func:`node_ids` gave the caller (None: listed here);
    ``lows``: the zones' low watermarks per node as the caller has them (None: read here);
    ``far``: the nodes :func:`memory_only` gave the caller (None: read here)."""
    if lows is None:
        zoneinfo = sysfs.read(ZONEINFO)
        lows = node_lows(parse_zoneinfo(zoneinfo), page_size) if zoneinfo else {}
    ids = node_ids(sysfs) if ids is None else ids
    nodes: list[NumaNode] = []
    if not ids:
        text = meminfo if meminfo is not None else sysfs.read(MEMINFO)
        if text is None:
            return []
        free, total = _free_and_total(parse_meminfo(text), MEMINFO)
        return [NumaNode(0, free, total, sum(lows.values()))]
    far = memory_only(sysfs) if far is None else far
    for node in ids:
        text = sysfs.read(f"{NODE_DIR}/node{node}/meminfo")
        if text is None:
            continue
        free, total = _free_and_total(parse_meminfo(text), f"node {node} meminfo")
        nodes.append(NumaNode(node, free, total, lows.get(node, 0), node in far))
    return nodes


def _free_and_total(info: Mapping[str, int], what: str) -> tuple[int, int]:
    """MemFree and MemTotal, which every kernel writes: a file without them was cut short,
    and taking the missing figure for 0 would read as a node with no free memory."""
    for name in ("MemFree", "MemTotal"):
        if name not in info:
            raise NumaFormatError(f"{what} lacks {name}")
    return info["MemFree"], info["MemTotal"]
