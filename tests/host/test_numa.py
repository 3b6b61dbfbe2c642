"""NUMA node free memory and low watermarks from node meminfo and zoneinfo."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.host.numa import (
    NumaFormatError,
    NumaNode,
    meminfo_values,
    node_lows,
    parse_meminfo,
    parse_zoneinfo,
    read_meminfo,
    read_nodes,
    zone_blocks,
)
from reconciler.host.sysfs import SysFs
from tests.support.fakesys import GIB, ONE_ZONE, FakeHost, write

# Shaped like a real /proc/zoneinfo of a two-node x86 host (trimmed).
ZONEINFO = """\
Node 0, zone      DMA
  per-node stats
      nr_inactive_anon 15183
      nr_active_anon 71211
  pages free     3840
        boost    0
        min      8
        low      11
        high     14
        spanned  4095
        present  3998
        managed  3840
        protection: (0, 2991, 31953, 31953, 31953)
      nr_free_pages 3840
Node 0, zone    DMA32
  pages free     747766
        boost    0
        min      1640
        low      2050
        high     2460
        promo    2870
Node 0, zone   Normal
  pages free     5012
        min      5012
        low      6265
        high     7518
Node 0, zone  Movable
  pages free     0
        min      0
        low      0
        high     0
Node 1, zone   Normal
  per-node stats
      nr_inactive_anon 1
  pages free     6000000
        min      11000
        low      13750
        high     16500
"""


def lows(text: str) -> dict[int, int]:
    return node_lows(parse_zoneinfo(text), 4096)


def test_zoneinfo_low_is_summed_per_node() -> None:
    assert lows(ZONEINFO) == {0: (11 + 2050 + 6265) * 4096,
                                                  1: 13750 * 4096}


PAGESETS = """\
  pagesets
    cpu: 0
              count:    0
              high:     378
              batch:    63
  vm stats threshold: 4
        low      999999
  node_unreclaimable:  0
"""


def test_a_zones_block_runs_from_its_free_pages_to_its_pagesets() -> None:
    # The per-node counters before the free pages and everything from the pagesets on are not
    # read: a "low" line there (none is, on the kernel) would count, as would "high:" lines.
    text = "junk before\n" + ZONEINFO.replace("        protection:", PAGESETS + "  protection:")
    blocks = list(zone_blocks(text))
    assert [header for header, _ in blocks] == [
        "Node 0, zone      DMA", "Node 0, zone    DMA32", "Node 0, zone   Normal",
        "Node 0, zone  Movable", "Node 1, zone   Normal"]
    dma = blocks[0][1]
    assert dma.startswith("  pages free     3840\n")
    assert dma.endswith("        managed  3840")
    assert "nr_inactive_anon" not in dma
    # without a pagesets line, to the end of the zone
    assert blocks[1][1].endswith("        promo    2870")
    assert lows(text) == lows(ZONEINFO)


def test_a_zone_without_free_pages_is_read_from_its_header() -> None:
    [(header, block)] = zone_blocks("Node 3, zone Normal\n        low      7\n")
    assert (header, block) == ("Node 3, zone Normal", "        low      7\n")
    # the kernel writes the free pages and all three watermarks for every zone
    with pytest.raises(NumaFormatError, match="zone Normal of node 3 lacks free, min, high"):
        parse_zoneinfo("Node 3, zone Normal\n        low      7\n")


WHOLE_ZONE = "Node 0, zone Normal\n  pages free 5\n        min 1\n        low 7\n        high 9\n"


def test_a_malformed_zone_header_is_an_error() -> None:
    assert lows(WHOLE_ZONE) == {0: 7 * 4096}
    with pytest.raises(NumaFormatError, match="not understood"):
        parse_zoneinfo(WHOLE_ZONE.replace("Node 0", "Node x"))


def test_zoneinfo_garbage_value() -> None:
    with pytest.raises(NumaFormatError, match="not understood"):
        parse_zoneinfo(WHOLE_ZONE.replace("low 7", "low many"))


def test_node_meminfo() -> None:
    text = "Node 1 MemTotal:       32768 kB\nNode 1 MemFree:        1024 kB\n" \
           "Node 1 HugePages_Total:     0\n"
    assert parse_meminfo(text) == {"MemTotal": 32 << 20, "MemFree": 1 << 20,
                                   "HugePages_Total": 0}


def test_meminfo_garbage() -> None:
    with pytest.raises(NumaFormatError):
        parse_meminfo("Node 0 MemFree lots\n")


def test_watermark_and_headroom() -> None:
    node = NumaNode(0, free_bytes=10 * GIB, total_bytes=64 * GIB, low_watermark_bytes=1 * GIB)
    assert node.watermark(4 * GIB, 1.0) == 4 * GIB
    assert node.watermark(0, 6.0) == 6 * GIB
    assert node.headroom(4 * GIB, 1.0) == 6 * GIB


@pytest.mark.parametrize("count", [1, 2, 4])
def test_read_nodes_from_fake_host(tmp_path: Path, count: int) -> None:
    host = FakeHost(tmp_path)
    host.set_numa([(i * GIB + GIB, 16 * GIB, 1000 * (i + 1)) for i in range(count)])
    nodes = read_nodes(SysFs(tmp_path), 4096)
    assert [n.id for n in nodes] == list(range(count))
    assert [n.free_bytes for n in nodes] == [i * GIB + GIB for i in range(count)]
    assert [n.low_watermark_bytes for n in nodes] == [1000 * (i + 1) * 4096
                                                      for i in range(count)]


def test_kernel_without_numa_is_one_node(tmp_path: Path) -> None:
    write(tmp_path / "proc/meminfo", "MemTotal: 2048 kB\nMemFree: 1024 kB\n")
    write(tmp_path / "proc/zoneinfo", ONE_ZONE)
    assert read_nodes(SysFs(tmp_path), 4096) == [NumaNode(0, 1 << 20, 2 << 20, 40960)]


def test_kernel_without_numa_takes_the_meminfo_read_by_the_caller(tmp_path: Path) -> None:
    write(tmp_path / "proc/meminfo", "MemTotal: 4096 kB\nMemFree: 4096 kB\n")
    write(tmp_path / "proc/zoneinfo", ONE_ZONE)
    given = "MemTotal: 2048 kB\nMemFree: 1024 kB\n"
    assert read_nodes(SysFs(tmp_path), 4096, given) == [NumaNode(0, 1 << 20, 2 << 20, 40960)]
    # with NUMA nodes, the text is not needed
    FakeHost(tmp_path).set_numa([(GIB, 16 * GIB, 1000)])
    assert read_nodes(SysFs(tmp_path), 4096, given) == [NumaNode(0, GIB, 16 * GIB, 1000 * 4096)]


def test_nothing_readable_is_no_nodes(tmp_path: Path) -> None:
    assert read_nodes(SysFs(tmp_path), 4096) == []


@pytest.mark.real_kernel
def test_this_machine_parses() -> None:
    nodes = read_nodes(SysFs("/"), 4096)
    assert nodes
    assert all(n.total_bytes > 0 and n.low_watermark_bytes > 0 for n in nodes)


def test_meminfo_is_bytes_or_empty_when_unusable(tmp_path: Path) -> None:
    sysfs = SysFs(tmp_path)
    assert read_meminfo(sysfs) == {}  # no /proc/meminfo
    meminfo = tmp_path / "proc" / "meminfo"
    meminfo.parent.mkdir(parents=True)
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:        8192 kB\n")
    assert read_meminfo(sysfs) == {"MemTotal": 16384 * 1024, "MemFree": 8192 * 1024}
    meminfo.write_text("MemTotal: lots\n")
    assert read_meminfo(sysfs) == {}
    assert meminfo_values(None) == meminfo_values("MemTotal: lots\n") == {}
    assert meminfo_values("MemFree: 1 kB\n") == {"MemFree": 1024}
