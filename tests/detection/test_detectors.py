"""The detectors on kernel files copied from a real machine, variants built from them, and
malformed, truncated and empty text; every threshold at its exact value."""

from __future__ import annotations

import dataclasses
import re

import pytest

from reconciler.detection import detectors as d
from reconciler.detection.config import DetectionConfig
from reconciler.detection.signals import NODE, Level, numa_scope, pod_scope
from reconciler.host.numa import NumaFormatError, parse_zoneinfo
from reconciler.host.parse import ParseError, parse_counters, parse_psi
from tests.support.paths import KERNEL_FIXTURES

PAGE = 4096
GIB = 1 << 30
MIB = 1 << 20
CFG = DetectionConfig()
LOW = 41 * MIB
"""A machine's zones' low watermarks summed (far under every other term of W)."""


def fixture(name: str) -> str:
    return (KERNEL_FIXTURES / name).read_text()


def zone_low_bytes(zoneinfo: str, node: int | None = None) -> int:
    """The fixture's low watermarks summed, read independently of the parser under test."""
    total, current = 0, None
    for line in zoneinfo.splitlines():
        header = re.match(r"Node (\d+), zone", line)
        if header:
            current = int(header.group(1))
        elif re.fullmatch(r"\s+low\s+\d+", line) and (node is None or current == node):
            total += int(line.split()[1])
    return total * PAGE


def lows_of(zoneinfo: str) -> dict[int, int]:
    """Each node's low watermarks summed, in bytes (:func:`zone_low_bytes` per node)."""
    nodes = {int(n) for n in re.findall(r"^Node (\d+), zone", zoneinfo, re.M)}
    return {n: zone_low_bytes(zoneinfo, n) for n in nodes}


def meminfo(total_kb: int, free_kb: int) -> str:
    return f"MemTotal:       {total_kb} kB\nMemFree:        {free_kb} kB\nCached: 5 kB\n"


# -- parsers --------------------------------------------------------------------------------------

def test_real_pressure_file() -> None:
    text = fixture("proc_pressure_memory")
    some = int(re.search(r"^some .*total=(\d+)", text, re.M).group(1))  # type: ignore[union-attr]
    full = int(re.search(r"^full .*total=(\d+)", text, re.M).group(1))  # type: ignore[union-attr]
    psi = parse_psi(text)
    assert (psi.some_total_us, psi.full_total_us) == (some, full)


@pytest.mark.parametrize(("text", "reason"), [
    ("", "empty pressure file"),
    ("full avg10=0.00 avg60=0.00 avg300=0.00 total=1\n", "no 'some' line"),
    ("some avg10=0.00 avg60=0.21 avg300=0.39 tot", "no total"),
    ("some avg10=0.00 avg60=0.21 avg300=0.39 total=12x\n", "no total"),
    ("pressure is high\n", "not understood"),
])
def test_malformed_pressure_files(text: str, reason: str) -> None:
    with pytest.raises(ParseError, match=reason):
        parse_psi(text)


def test_a_pressure_file_without_full_line() -> None:
    psi = parse_psi("some avg10=1.00 avg60=0.00 avg300=0.00 total=42\n")
    assert (psi.some_total_us, psi.full_total_us) == (42, None)


def test_real_zoneinfo() -> None:
    zones = parse_zoneinfo(fixture("proc_zoneinfo"))
    assert [z.name for z in zones] == ["DMA", "DMA32", "Normal", "Movable", "Device"]
    normal = zones[2]
    assert (normal.node, normal.free_pages, normal.min_pages, normal.low_pages,
            normal.high_pages) == (0, 1607013, 12111, 15138, 18165)
    assert sum(z.low_pages for z in zones) * PAGE == zone_low_bytes(fixture("proc_zoneinfo"))


def test_zoneinfo_of_many_cpus_reads_as_of_few() -> None:
    """Every CPU adds a pageset entry to every zone; the zones read do not change."""
    real = fixture("proc_zoneinfo")
    entry = re.search(r"    cpu: 0\n(?:              .*\n)+  vm stats threshold: \d+\n", real)
    assert entry is not None
    many = real.replace(entry.group(0), entry.group(0) * 96)
    assert many.count("\n") > real.count("\n") + 90 * 6
    assert parse_zoneinfo(many) == parse_zoneinfo(real)


@pytest.mark.parametrize("cut", ["empty", "mid_zone", "garbage", "header"])
def test_broken_zoneinfo(cut: str) -> None:
    real = fixture("proc_zoneinfo")
    text = {"empty": "",
            "mid_zone": real[:real.index("        low      15138")],
            "garbage": real.replace("low      15138", "low      lots"),
            "header": real.replace("Node 0, zone   Normal", "Node 0, zone")}[cut]
    with pytest.raises(NumaFormatError):
        parse_zoneinfo(text)


def test_counters() -> None:
    stat = parse_counters(fixture("v1_pod_memory.stat"))
    assert stat["total_rss"] == 51466240
    with pytest.raises(ParseError, match="empty"):
        parse_counters("")
    with pytest.raises(ParseError, match="not understood"):
        parse_counters("rss 12\ncache\n")
    with pytest.raises(ParseError, match="not understood"):
        parse_counters("rss twelve\n")


# -- system free ----------------------------------------------------------------------------------

def test_system_free_on_the_real_files() -> None:
    info, zoneinfo = fixture("proc_meminfo"), fixture("proc_zoneinfo")
    wsf = fixture("proc_sys_vm_watermark_scale_factor")
    free_kb = int(re.search(r"MemFree:\s+(\d+)", info).group(1))  # type: ignore[union-attr]
    total_kb = int(re.search(r"MemTotal:\s+(\d+)", info).group(1))  # type: ignore[union-attr]
    sample = d.system_free(info, zone_low_bytes(zoneinfo), wsf, 1, CFG, 7.0)
    mark = max(GIB, total_kb * 1024 * int(wsf) / 10000 * 2, zone_low_bytes(zoneinfo))
    assert sample.value == free_kb * 1024
    assert sample.thresholds == (mark * 2, mark, mark * 0.5)
    assert (sample.level, sample.scope, sample.at) == (Level.NONE, NODE, 7.0)
    assert sample.reading(Level.NONE).threshold == mark * 2  # LOW's threshold when none


@pytest.mark.parametrize(("free_kb", "level"), [
    (2 * 1024 * 1024, Level.NONE),  # exactly 2 W: not below
    (2 * 1024 * 1024 - 1, Level.LOW),
    (1024 * 1024, Level.LOW),  # exactly W
    (1024 * 1024 - 1, Level.MEDIUM),
    (512 * 1024, Level.MEDIUM),  # exactly W / 2
    (512 * 1024 - 1, Level.HIGH),
])
def test_system_free_levels_at_their_thresholds(free_kb: int, level: Level) -> None:
    # W = the 1 GiB floor (a 16 GiB machine: the other terms are far below it, and 10 % of
    # its memory above it)
    sample = d.system_free(meminfo(16 * 1024 * 1024, free_kb), LOW, "10", 1, CFG, 0.0)
    assert sample.level is level
    assert sample.reading(level).threshold == {Level.NONE: 2 * GIB, Level.LOW: 2 * GIB,
                                               Level.MEDIUM: GIB, Level.HIGH: GIB / 2}[level]


def test_watermark_terms() -> None:
    low = zone_low_bytes(fixture("proc_zoneinfo"))
    no_floor = dataclasses.replace(CFG, free_floor_bytes=0)
    # total x wsf / 10000 x 2 dominates: 1 TiB x 10 / 10000 x 2, about 2.2 GB
    big = d.system_free(meminfo(1 << 30, 100), low, "10", 1, no_floor, 0.0)
    assert big.thresholds[1] == int((1 << 40) * 10 / 10000 * 2)
    # the zones' low watermarks dominate
    zone = dataclasses.replace(no_floor, free_wsf_factor=0, free_zone_low_factor=3.0)
    sample = d.system_free(meminfo(1 << 20, 100), low, "10", 1, zone, 0.0)
    assert sample.thresholds[1] == low * 3
    # a kernel without vm.watermark_scale_factor: no such term
    assert d.system_free(meminfo(1 << 30, 100), low, None, 1, no_floor,
                         0.0).thresholds[1] == low
    # the floor counts once per NUMA node
    assert d.system_free(meminfo(64 << 20, 100), low, "10", 4, CFG,
                         0.0).thresholds[1] == 4 * GIB


@pytest.mark.parametrize(("total", "mark"), [
    (10 * GIB, GIB),  # 10 % of 10 GiB is the 1 GiB floor itself
    (10 * GIB + 10 * 1024, GIB),  # above it the floor holds
    (10 * GIB - 10 * 1024, GIB - 1024),  # below it the share does
    (4 * GIB, 4 * GIB // 10),  # a 4 GiB node keeps 410 MiB, not 1 GiB
])
def test_the_floor_is_at_most_a_share_of_the_memory(total: int, mark: int) -> None:
    no_other_term = dataclasses.replace(CFG, free_wsf_factor=0, free_zone_low_factor=0)
    sample = d.system_free(meminfo(total // 1024, total // 2048), LOW, "10", 1, no_other_term,
                           0.0)
    assert sample.thresholds[1] == mark
    text = f"Node 0 MemTotal: {total // 1024} kB\nNode 0 MemFree: {total // 2048} kB\n"
    [node] = d.numa_free({0: text}, lows_of(fixture("numa2_zoneinfo")), "10", no_other_term,
                         0.0)
    assert node.thresholds[1] == mark


def test_an_idle_four_gib_node_is_not_under_pressure() -> None:
    """3.8 GiB free of 4 GiB over two NUMA nodes: with the fixed 1 GiB floor per node this was
    level low (free under 2 x 2 GiB), and the ladder stayed engaged on an idle node."""
    sample = d.system_free(meminfo(4 << 20, 3891 << 10), LOW, "10", 2, CFG, 0.0)
    assert sample.level is Level.NONE


@pytest.mark.parametrize(("meminfo_text", "wsf", "reason"), [
    ("", "10", "lacks MemFree"),
    ("MemTotal:       24684092 kB\n", "10", "lacks MemFree"),
    ("MemTotal:       24684092 kB\nMemFree:        lots kB\n", "10", "not understood"),
    (None, "ten", "not an integer"),
])
def test_system_free_unknown(meminfo_text: str | None, wsf: str, reason: str) -> None:
    sample = d.system_free(fixture("proc_meminfo") if meminfo_text is None else meminfo_text,
                           LOW, wsf, 1, CFG, 3.0)
    assert sample.level is Level.UNKNOWN
    assert reason in sample.reason
    assert sample.reading(Level.UNKNOWN).threshold == 0


# -- NUMA free ------------------------------------------------------------------------------------

def test_numa_free_on_two_nodes() -> None:
    zoneinfo = fixture("numa2_zoneinfo")
    samples = d.numa_free({0: fixture("numa2_node0_meminfo"), 1: fixture("numa2_node1_meminfo")},
                          lows_of(zoneinfo), "10", CFG, 1.0)
    assert [s.scope for s in samples] == [numa_scope(0), numa_scope(1)]
    node0, node1 = samples
    assert node0.level is Level.NONE
    # node 1: 240 MiB free against W = the 1 GiB floor (its zone's low watermark is 54 MiB)
    assert zone_low_bytes(zoneinfo, 1) == 13750 * PAGE
    assert node1.value == 240 * MIB
    assert node1.thresholds[1] == GIB
    assert node1.level is Level.HIGH


def test_numa_free_uses_each_nodes_own_watermark() -> None:
    zoneinfo = fixture("numa2_zoneinfo")
    cfg = dataclasses.replace(CFG, free_floor_bytes=0, free_wsf_factor=0)
    node1 = fixture("numa2_node1_meminfo")
    [sample] = d.numa_free({1: node1}, lows_of(zoneinfo), "10", cfg, 0.0)
    assert sample.thresholds[1] == zone_low_bytes(zoneinfo, 1)


def test_numa_free_broken_input() -> None:
    lows = lows_of(fixture("numa2_zoneinfo"))
    samples = d.numa_free({0: None, 1: "Node 1 MemTotal: 5 kB\nNode 1 MemFree: x kB\n"},
                          lows, "10", CFG, 0.0)
    assert [s.level for s in samples] == [Level.UNKNOWN, Level.UNKNOWN]
    assert "gone" in samples[0].reason
    assert "not understood" in samples[1].reason
    [bad] = d.numa_free({0: fixture("node0_meminfo")}, lows, "ten", CFG, 0.0)
    assert bad.level is Level.UNKNOWN
    assert "not an integer" in bad.reason


# -- PSI ------------------------------------------------------------------------------------------

def stall(at: float, some: int, full: int | None = 0) -> d.Stall:
    return d.Stall(at, some, full)


@pytest.mark.parametrize(("some_us", "full_us", "level"), [
    (9_999, 0, Level.NONE),
    (10_000, 0, Level.LOW),  # exactly 10 % of 100 ms
    (29_999, 0, Level.LOW),
    (30_000, 0, Level.MEDIUM),
    (30_000, 49_999, Level.MEDIUM),
    (60_000, 50_000, Level.HIGH),  # full exactly 50 %
])
def test_psi_levels_at_their_thresholds(some_us: int, full_us: int, level: Level) -> None:
    base = d.read_stall(fixture("proc_pressure_memory"), 10.0)
    after = stall(10.1, base.some_us + some_us, (base.full_us or 0) + full_us)
    sample = d.psi_sample(NODE, base, after, CFG)
    assert sample is not None
    assert sample.level is level
    assert sample.value == pytest.approx((full_us if level is Level.HIGH else some_us) / 1000)


def test_psi_without_a_rate() -> None:
    assert d.psi_sample(NODE, stall(1.0, 100), stall(1.0, 200), CFG) is None  # no time passed
    assert d.psi_sample(NODE, stall(1.0, 500), stall(2.0, 100), CFG) is None  # counter reset
    # a pod's reading carries its uid
    sample = d.psi_sample(pod_scope("u"), stall(1.0, 0), stall(2.0, 0), CFG, "u")
    assert sample is not None
    assert sample.pod_uid == "u"
    assert sample.level is Level.NONE


def test_v2_pod_pressure_file() -> None:
    psi = d.read_stall(fixture("v2_pod_memory.pressure"), 0.0)
    assert (psi.some_us, psi.full_us) == (4512389, 3801122)


def test_trigger_sample_is_low_at_the_trigger_threshold() -> None:
    sample = d.psi_trigger_sample(NODE, 500, CFG, 4.0)
    assert (sample.level, sample.value, sample.at) == (Level.LOW, 10.0, 4.0)
    assert "50 ms within 500 ms" in sample.reason


# -- memcg pressure events ------------------------------------------------------------------------

def test_pressure_levels_map_to_levels() -> None:
    assert [d.pressure_event_sample(NODE, name, 3, 0.0).level
            for name in ("low", "medium", "critical")] == [Level.LOW, Level.MEDIUM, Level.HIGH]
    assert d.pressure_quiet_sample(NODE, 0.0).level is Level.NONE


# -- kswapd ---------------------------------------------------------------------------------------

def test_reclaim_counters_from_the_real_vmstat() -> None:
    text = fixture("proc_vmstat")
    steal = int(re.search(r"^pgsteal_kswapd (\d+)", text, re.M).group(1))  # type: ignore[union-attr]
    scan = int(re.search(r"^pgscan_kswapd (\d+)", text, re.M).group(1))  # type: ignore[union-attr]
    assert d.read_reclaim(text, 1.0) == d.Reclaim(1.0, steal, scan)


def test_reclaim_counters_of_older_kernels_are_summed() -> None:
    text = ("pgsteal_kswapd_dma 1\npgsteal_kswapd_normal 10\npgscan_kswapd_normal 30\n"
            "pgscan_kswapd_dma32 3\npgdemote_kswapd 1000\n")
    assert d.read_reclaim(text, 0.0) == d.Reclaim(0.0, 11, 33)
    with pytest.raises(ParseError, match="lacks pgsteal_kswapd"):
        d.read_reclaim("pgfault 12\n", 0.0)
    with pytest.raises(ParseError):
        d.read_reclaim(fixture("proc_vmstat")[:200] + "pgsteal_kswapd\n", 0.0)


def history(*points: tuple[float, int]) -> list[d.Reclaim]:
    return [d.Reclaim(at, steal, steal * 2) for at, steal in points]


@pytest.mark.parametrize(("stolen", "level"), [
    (19_999, Level.NONE), (20_000, Level.LOW), (200_000, Level.MEDIUM)])
def test_kswapd_rate_over_the_window(stolen: int, level: Level) -> None:
    sample = d.kswapd_sample(history((0.0, 0), (10.0, stolen)), CFG)
    assert sample is not None
    assert sample.value == stolen / 10
    assert sample.level is level
    # 10 s window: the burst before 5.0 is older than the window and does not count
    sample = d.kswapd_sample(history((0.0, 0), (5.0, 10**9), (15.0, 10**9 + stolen)), CFG)
    assert sample is not None
    assert (sample.value, sample.level) == (stolen / 10, level)


def test_kswapd_window_base_is_the_last_sample_old_enough() -> None:
    sample = d.kswapd_sample(history((0.0, 0), (5.0, 100_000), (16.0, 120_000)), CFG)
    assert sample is not None
    assert sample.value == pytest.approx(20_000 / 11, abs=0.05)


def test_kswapd_counter_reset_is_not_a_spike() -> None:
    points = history((0.0, 10**12), (1.0, 5), (2.0, 2005))
    sample = d.kswapd_sample(points, CFG)
    assert sample is not None
    assert sample.value == 2000
    assert sample.level is Level.LOW
    assert d.kswapd_sample(history((0.0, 10**12), (1.0, 5)), CFG) is None
    assert d.kswapd_sample(history((3.0, 5)), CFG) is None


def test_kswapd_high_is_off_by_default_and_can_be_set() -> None:
    points = history((0.0, 0), (1.0, 10**7))
    assert d.kswapd_sample(points, CFG).level is Level.MEDIUM  # type: ignore[union-attr]
    strict = dataclasses.replace(CFG, kswapd_high_pages_per_s=1e6)
    assert d.kswapd_sample(points, strict).level is Level.HIGH  # type: ignore[union-attr]


# -- RSS overuse ----------------------------------------------------------------------------------

def test_anonymous_memory_never_counts_huge_pages_twice_nor_cache() -> None:
    v1 = parse_counters(fixture("v1_pod_memory.stat"))
    assert d.anonymous_bytes(fixture("v1_pod_memory.stat"), v2=False) == v1["total_rss"]
    assert v1["total_rss_huge"] > 0
    assert v1["total_cache"] > 0
    v2 = parse_counters(fixture("v2_pod_memory.stat"))
    assert d.anonymous_bytes(fixture("v2_pod_memory.stat"), v2=True) == v2["anon"]
    # a leaf v1 cgroup has no total_ lines
    assert d.anonymous_bytes("cache 5\nrss 7\nrss_huge 2\n", v2=False) == 7


@pytest.mark.parametrize(("request_bytes", "level"), [
    (51466240, Level.LOW),  # exactly the request
    (51466241, Level.NONE),
    (49015467, Level.LOW),  # 1.05 x this is just below the usage
    (49015466, Level.HIGH),
])
def test_rss_overuse_levels(request_bytes: int, level: Level) -> None:
    sample = d.rss_overuse("u1", fixture("v1_pod_memory.stat"), False, request_bytes, 1.05, 2.0)
    assert sample.level is level
    assert (sample.scope, sample.pod_uid) == (pod_scope("u1"), "u1")
    assert sample.thresholds == (request_bytes, None, request_bytes * 1.05)


def test_rss_overuse_exactly_at_request_times_factor() -> None:
    sample = d.rss_overuse("u", "anon 2100\nfile 999999\n", True, 2000, 1.05, 0.0)
    assert sample.level is Level.HIGH  # 2000 x 1.05 = 2100: reached
    assert d.rss_overuse("u", "anon 2099\n", True, 2000, 1.05, 0.0).level is Level.LOW


def test_rss_overuse_unknown() -> None:
    assert d.rss_overuse("u", None, True, 1, 1.05, 0.0).level is Level.UNKNOWN
    broken = d.rss_overuse("u", "file 12\n", True, 1, 1.05, 0.0)
    assert broken.level is Level.UNKNOWN
    assert "lacks anon" in broken.reason
    assert d.rss_overuse("u", "", False, 1, 1.05, 0.0).level is Level.UNKNOWN


@pytest.mark.parametrize(("value", "factor", "problem"), [
    (None, 1.05, ""),
    ("1.01", 1.01, ""),
    (" 0.9 ", 0.9, ""),
    ("1.05", 1.05, ""),
    ("1.5", 1.05, "not stricter"),
    ("0", 1.05, "not stricter"),
    ("0.1", 0.1, ""),  # the smallest factor, exactly
    ("0.099999", 1.05, "below the smallest"),
    ("-1", 1.05, "not a decimal number"),
    ("plenty", 1.05, "not a decimal number"),
    # float() takes all of these; none is a factor a pod means.
    ("nan", 1.05, "not a decimal number"),
    ("-inf", 1.05, "not a decimal number"),
    ("1e-300", 1.05, "not a decimal number"),
    ("0_5", 1.05, "not a decimal number"),
    ("\u0660.\u0665", 1.05, "not a decimal number"),  # Arabic-Indic digits: 0.5
    ("\u00a00.5", 1.05, "not a decimal number"),  # a no-break space is not ASCII whitespace
    ("0.5\x00", 1.05, "not a decimal number"),
])
def test_pod_factor_may_only_be_stricter(value: str | None, factor: float, problem: str) -> None:
    annotations = {} if value is None else {"nri-qos.io/rss-overuse-factor": value}
    got, why = d.pod_factor(annotations, "nri-qos.io/rss-overuse-factor", 1.05)
    assert got == factor
    assert (problem in why) if problem else why == ""


# -- fulfillment ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("cap_pages", "level"), [
    (1000, Level.NONE),  # ratio exactly 1.0: not below
    (999, Level.LOW),
    (800, Level.LOW),  # exactly 0.8
    (799, Level.MEDIUM),
    (500, Level.MEDIUM),  # exactly 0.5
    (499, Level.HIGH),
])
def test_fulfillment_levels(cap_pages: int, level: Level) -> None:
    sample = d.fulfillment(f"{cap_pages * PAGE}\n", 1000 * PAGE, CFG, 0.0)
    assert sample is not None
    assert sample.level is level
    assert sample.value == cap_pages / 1000


def test_fulfillment_without_requests_or_cap_or_file() -> None:
    assert d.fulfillment("1000\n", 0, CFG, 0.0) is None
    assert d.fulfillment("max\n", GIB, CFG, 0.0) is None
    assert d.fulfillment("9223372036854771712\n", GIB, CFG, 0.0) is None  # v1 unlimited
    assert d.fulfillment(None, GIB, CFG, 0.0).level is Level.UNKNOWN  # type: ignore[union-attr]
    garbage = d.fulfillment("lots\n", GIB, CFG, 0.0)
    assert garbage is not None
    assert garbage.level is Level.UNKNOWN


def test_threshold_config_must_be_ordered() -> None:
    assert DetectionConfig().validate() == []
    bad = dataclasses.replace(CFG, psi_some_low_percent=40.0, fulfillment_high_ratio=0.9,
                              kswapd_medium_pages_per_s=1000.0)
    keys = [key for key, _ in bad.validate()]
    assert keys == ["psi_some_medium_percent", "kswapd_medium_pages_per_s",
                    "fulfillment_high_ratio"]
    # 0 leaves a kswapd level unused without breaking the order
    assert dataclasses.replace(CFG, kswapd_medium_pages_per_s=0.0).validate() == []


@pytest.mark.parametrize(("before_full", "now_full"), [(None, None), (0, None), (None, 10**9)])
def test_psi_without_a_full_line_counts_no_full_stall(before_full: int | None,
                                                       now_full: int | None) -> None:
    """A file without 'full' (or a counter that appeared meanwhile) says nothing of full
    stalls: graded from 'some' alone, even at the lowest 'full' threshold allowed."""
    cfg = dataclasses.replace(CFG, psi_full_high_percent=0.1)
    sample = d.psi_sample(NODE, stall(1.0, 0, before_full), stall(1.1, 35_000, now_full), cfg)
    assert sample is not None
    assert sample.level is Level.MEDIUM
    assert sample.value == pytest.approx(35.0)
    assert "full 0.0 %" in sample.reason
