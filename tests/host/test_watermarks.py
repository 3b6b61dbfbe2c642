"""The zones' low watermarks: one aged reading shared by the loops that compare free memory with
them."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from reconciler.host.numa import NumaFormatError
from reconciler.host.values import PAGE_SIZE
from reconciler.host.watermarks import MAX_AGE_S, Watermarks
from tests.support.counting import CountingSysFs
from tests.support.fakesys import GIB, FakeHost

ZONEINFO = "/proc/zoneinfo"


def two_nodes(tmp_path: Path, low: int = 1000) -> tuple[FakeHost, CountingSysFs]:
    host = FakeHost(tmp_path, version=2)
    host.set_numa([(8 * GIB, 32 * GIB, low), (8 * GIB, 32 * GIB, low)])
    return host, CountingSysFs(tmp_path, AuditLog(MemoryAuditSink()))


def test_a_reading_serves_every_caller_for_a_minute(tmp_path: Path) -> None:
    assert MAX_AGE_S == 60.0
    host, sysfs = two_nodes(tmp_path)
    marks = Watermarks(sysfs)
    first = marks.at(100.0)
    assert first.node_lows() == {0: 1000 * PAGE_SIZE, 1: 1000 * PAGE_SIZE}
    assert first.nodes == (0, 1)
    assert first.watermark_scale_factor is None  # the fake host has no such file
    host.set_numa([(8 * GIB, 32 * GIB, 2000), (8 * GIB, 32 * GIB, 2000)])
    # a loop whose cycle began just before the reading asks with an earlier time
    for now in (100.0, 130.0, 159.999, 99.5, 40.001):
        assert marks.at(now) is first
    assert sysfs.reads[ZONEINFO] == 1
    assert sysfs.listed["/sys/devices/system/node"] == 1
    later = marks.at(160.0)  # a minute after it was read: again, and the change is seen
    assert later.node_lows() == {0: 2000 * PAGE_SIZE, 1: 2000 * PAGE_SIZE}
    assert sysfs.reads[ZONEINFO] == 2
    assert marks.at(100.0).at == 100.0  # a minute before the reading: again
    assert sysfs.reads[ZONEINFO] == 3


def test_without_zoneinfo_the_floor_decides_and_it_is_read_again_next_time(
        tmp_path: Path) -> None:
    _, sysfs = two_nodes(tmp_path)
    text = (tmp_path / "proc/zoneinfo").read_text()
    (tmp_path / "proc/zoneinfo").unlink()
    marks = Watermarks(sysfs)
    reading = marks.at(0.0)
    assert (reading.lows, reading.missing) == (None, True)
    assert reading.problem == "/proc/zoneinfo is missing"
    assert reading.node_lows() == {}
    assert marks.at(0.0) is reading  # the same caller's time: not read twice
    assert sysfs.reads[ZONEINFO] == 1
    (tmp_path / "proc/zoneinfo").write_text(text)
    assert marks.at(1.0).node_lows() == {0: 1000 * PAGE_SIZE, 1: 1000 * PAGE_SIZE}
    assert sysfs.reads[ZONEINFO] == 2


def test_a_zoneinfo_not_understood_is_an_error_for_the_loops(tmp_path: Path) -> None:
    _, sysfs = two_nodes(tmp_path)
    path = tmp_path / "proc/zoneinfo"
    path.write_text(re.sub(r"(?m)^\s+low\s+\d+\n", "", path.read_text()))
    reading = Watermarks(sysfs).at(0.0)
    assert (reading.lows, reading.missing) == (None, False)
    assert "lacks low" in reading.problem
    with pytest.raises(NumaFormatError, match="lacks low"):
        reading.node_lows()


def test_loops_asking_at_once_share_one_reading(tmp_path: Path) -> None:
    _, sysfs = two_nodes(tmp_path)
    marks = Watermarks(sysfs)
    start = threading.Barrier(8)
    got: list[object] = []

    def ask() -> None:
        start.wait()
        got.append(marks.at(5.0))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sysfs.reads[ZONEINFO] == 1
    assert len({id(reading) for reading in got}) == 1
