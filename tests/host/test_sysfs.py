"""The sysfs layer: rooted paths, write-if-changed with audit, error classification."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from reconciler.host.sysfs import (
    Outcome,
    SysFs,
    SysPathError,
    read_file_bytes,
    read_id_file,
    short_reclaim,
)
from reconciler.host.values import (
    format_id_list,
    parse_bytes,
    parse_id_list,
    same_bytes,
    same_id_list,
)
from tests.support.fakesys import write
from tests.support.refusals import refuse_writes


@pytest.fixture
def sink() -> MemoryAuditSink:
    return MemoryAuditSink()


@pytest.fixture
def fs(tmp_path: Path, sink: MemoryAuditSink) -> SysFs:
    return SysFs(tmp_path, AuditLog(sink), retries=3, backoff_s=0.0, sleep=lambda _: None)


def test_paths_are_mapped_below_the_root(fs: SysFs, tmp_path: Path) -> None:
    assert fs.real("/sys/fs/cgroup/memory") == f"{tmp_path}/sys/fs/cgroup/memory"


@pytest.mark.parametrize("bad", ["sys/fs", "/sys/../etc/passwd", "/sys//x", "/sys/./x",
                                 "/sys/fs/..", "/a\0b"])
def test_escaping_paths_are_rejected(fs: SysFs, bad: str) -> None:
    with pytest.raises(SysPathError):
        fs.real(bad)


def test_write_if_changed_writes_once_and_audits_once(
        fs: SysFs, tmp_path: Path, sink: MemoryAuditSink) -> None:
    f = write(tmp_path / "sys/fs/cgroup/memory.high", "max\n")
    assert fs.write_if_changed("/sys/fs/cgroup/memory.high", "1048576", "test") == Outcome.WRITTEN
    assert f.read_text() == "1048576"
    assert fs.write_if_changed("/sys/fs/cgroup/memory.high", "1048576", "test") \
        == Outcome.UNCHANGED
    assert sink.named("cgroup_write") == [
        {"path": "/sys/fs/cgroup/memory.high", "value": "1048576", "reason": "test"}]


def test_shorter_value_replaces_the_whole_file(fs: SysFs, tmp_path: Path) -> None:
    f = write(tmp_path / "proc/7/oom_score_adj", "1000\n")
    fs.write_if_changed("/proc/7/oom_score_adj", "5", "test")
    assert f.read_text() == "5"


def test_missing_file_is_gone_not_an_error(fs: SysFs, sink: MemoryAuditSink) -> None:
    assert fs.write_if_changed("/sys/fs/cgroup/gone/memory.max", "1", "t") == Outcome.GONE
    assert fs.write("/sys/fs/cgroup/gone/memory.max", "1", "t") == Outcome.GONE
    assert fs.read("/sys/fs/cgroup/gone/memory.max") is None
    assert fs.read_ids("/sys/fs/cgroup/gone/tasks") is None
    assert sink.records == []


def test_no_file_is_ever_created(fs: SysFs, tmp_path: Path) -> None:
    fs.write("/sys/fs/cgroup/new", "1", "t")
    assert not (tmp_path / "sys/fs/cgroup/new").exists()


def test_einval_is_retried_then_audited_as_failed(sink: MemoryAuditSink) -> None:
    # /proc/self/oom_score_adj is real on every Linux and refuses a non-number with EINVAL.
    sleeps: list[float] = []
    fs = SysFs("/", AuditLog(sink), retries=3, backoff_s=0.01, sleep=sleeps.append)
    assert fs.write("/proc/self/oom_score_adj", "not-a-number", "test") == Outcome.FAILED
    assert sleeps == [0.01, 0.02]
    [failed] = sink.named("cgroup_write_failed")
    assert failed["path"] == "/proc/self/oom_score_adj"
    assert failed["error"].startswith("EINVAL")
    assert sink.named("cgroup_write") == []


def test_other_errors_fail_without_retry(fs: SysFs, tmp_path: Path,
                                         sink: MemoryAuditSink) -> None:
    (tmp_path / "sys/fs/cgroup/dir").mkdir(parents=True)
    assert fs.write("/sys/fs/cgroup/dir", "1", "t") == Outcome.FAILED  # EISDIR
    assert sink.named("cgroup_write_failed")[0]["error"].startswith("EISDIR")


def test_write_if_changed_why_says_which_refusal_it_was(
        fs: SysFs, tmp_path: Path, sink: MemoryAuditSink, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "sys/fs/cgroup/cpuset.mems", "0\n")
    write(tmp_path / "sys/fs/cgroup/cpu.idle", "0\n")
    # as the kernel refuses an empty cpuset.mems to a cgroup in use
    refuse_writes(monkeypatch, errno.ENOSPC, lambda _, data: data == b"\n")
    assert fs.write_if_changed_why("/sys/fs/cgroup/cpuset.mems", "\n", "t") == (
        Outcome.FAILED, f"ENOSPC: {os.strerror(errno.ENOSPC)}")
    assert sink.named("cgroup_write_failed")[0]["error"] == (
        f"ENOSPC: {os.strerror(errno.ENOSPC)} (attempt 1)")
    assert fs.write_if_changed_why("/sys/fs/cgroup/cpu.idle", "1", "t") == (Outcome.WRITTEN, "")
    assert fs.write_if_changed_why("/sys/fs/cgroup/cpu.idle", "1", "t") == (
        Outcome.UNCHANGED, "")
    assert fs.write_if_changed_why("/sys/fs/cgroup/gone", "1", "t") == (Outcome.GONE, "")


def test_read_ids(fs: SysFs, tmp_path: Path) -> None:
    write(tmp_path / "sys/fs/cgroup/x/tasks", "1\n22\n333\n")
    write(tmp_path / "sys/fs/cgroup/y/tasks", "")
    assert fs.read_ids("/sys/fs/cgroup/x/tasks") == [1, 22, 333]
    assert fs.read_ids("/sys/fs/cgroup/y/tasks") == []
    big = "".join(f"{i}\n" for i in range(100_000))
    write(tmp_path / "big", big)
    assert read_id_file(str(tmp_path / "big")) == list(range(100_000))


def test_list_dir_of_missing_dir_is_empty(fs: SysFs) -> None:
    assert fs.list_dir("/sys/devices/system/node") == []


@pytest.mark.parametrize(("text", "value"), [
    ("max\n", None), ("-1", None), ("9223372036854771712\n", None), ("4096\n", 4096)])
def test_parse_bytes(text: str, value: int | None) -> None:
    assert parse_bytes(text) == value


def test_same_bytes_ignores_page_rounding_and_unlimited_spellings() -> None:
    assert same_bytes("999424\n", "1000000")
    assert not same_bytes("999424\n", "1003520")
    assert same_bytes("9223372036854771712\n", "max")
    assert not same_bytes("max", "4096")


def test_id_lists() -> None:
    assert parse_id_list("0-2,5\n") == {0, 1, 2, 5}
    assert parse_id_list("\n") == frozenset()
    assert format_id_list([5, 0, 2, 1]) == "0-2,5"
    assert same_id_list("0-1\n", "0,1")
    assert not same_id_list("0-1", "1")


def test_root_may_be_a_pathlike(tmp_path: Path) -> None:
    assert SysFs(os.fspath(tmp_path)).real("/proc") == f"{tmp_path}/proc"


def test_a_short_read_is_not_the_end_of_the_file(tmp_path: Path) -> None:
    """A seq_file hands out a buffer of whole records per read(); a FIFO written in two parts
    does the same: the reader must go on until read() returns nothing."""
    fifo = tmp_path / "seq"
    os.mkfifo(fifo)
    first, second = b"Node 0, zone Normal\n" * 200, b"Node 1, zone Normal\n" * 200

    def writer() -> None:
        with open(fifo, "wb", buffering=0) as f:
            f.write(first)
            time.sleep(0.2)  # the reader's first read() returns the first part only
            f.write(second)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert read_file_bytes(str(fifo)) == first + second
    finally:
        thread.join()


def test_a_short_reclaim_is_eagain_from_a_failed_write_only() -> None:
    eagain = "EAGAIN: Resource temporarily unavailable"
    assert short_reclaim(Outcome.FAILED, eagain)
    assert not short_reclaim(Outcome.FAILED, "EBUSY: Device or resource busy")
    assert not short_reclaim(Outcome.TIMEOUT, eagain)
    assert not short_reclaim(Outcome.WRITTEN, "")
