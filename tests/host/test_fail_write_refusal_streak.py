"""A write the kernel refuses at every cycle is said when the refusals start (one
``write_failed`` line, one ``cgroup_write_failed`` record) and when a write to the file is taken
again, and counted at every refusal: a node whose kernel keeps refusing one file is not flooded
with the same line every cycle."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.metrics import Metrics
from reconciler.host.sysfs import Outcome, SysFs
from tests.support.refusals import refuse_writes
from tests.support.v1_memcg import NEEDS_V1_MEMORY, Subtree, container_memcg

UID = "66666666-0000-4000-8000-000000000006"
CID = "e" * 64
MIB = 1 << 20
CYCLES = 20


def failed(metrics: Metrics, file: str) -> float:
    return metrics.registry.get_sample_value(
        "nri_qos_host_writes_total", {"file": file, "outcome": "failed"}) or 0.0


@pytest.fixture
def subtree() -> Iterator[Subtree]:
    with container_memcg("nriqos-fail-streak", "besteffort", UID, CID) as made:
        yield made


@NEEDS_V1_MEMORY[0]
@NEEDS_V1_MEMORY[1]
def test_a_limit_the_kernel_refuses_every_cycle_is_said_once_and_counted_each_time(
        subtree: Subtree) -> None:
    sink = MemoryAuditSink()
    metrics = Metrics()
    # Each view of the tree (a loop's own undo view is made per write) shares the streak.
    sysfs = SysFs("/", AuditLog(sink), backoff_s=0.0).metered(metrics)
    limit = f"{subtree.container}/memory.limit_in_bytes"
    with capture_logs() as logs:
        for _ in range(CYCLES):
            # the real kernel: a value that is not a number is EINVAL
            assert sysfs.unobserved().write_if_changed(limit, "lots", "test") is Outcome.FAILED
        said = [e for e in logs if e["event"] == "write_failed"]
        assert len(said) == 1
        assert said[0]["error"].startswith("EINVAL")
        assert len(sink.named("cgroup_write_failed")) == 1
        assert failed(metrics, "memory.limit_in_bytes") == CYCLES
        # taken again: said, and a refusal after it starts a new streak
        assert sysfs.write_if_changed(limit, str(512 * MIB), "test") is Outcome.WRITTEN
        ended = [e for e in logs if e["event"] == "write_refusals_ended"]
        assert [e["path"] for e in ended] == [limit]
        assert sysfs.write_if_changed(limit, "lots", "test") is Outcome.FAILED
    assert len([e for e in logs if e["event"] == "write_failed"]) == 2
    assert len(sink.named("cgroup_write_failed")) == 2
    assert Path(limit).read_text().strip() == str(512 * MIB)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EPERM, errno.EBUSY])
def test_a_refusal_of_another_kind_on_the_same_file_is_said_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    cpuset = tmp_path / "sys/fs/cgroup/cpuset/pod"
    cpuset.mkdir(parents=True)
    (cpuset / "cpuset.mems").write_text("0\n")
    sink = MemoryAuditSink()
    metrics = Metrics()
    sysfs = SysFs(tmp_path, AuditLog(sink), backoff_s=0.0, metrics=metrics)
    path = "/sys/fs/cgroup/cpuset/pod/cpuset.mems"

    def refused(real: str, data: bytes) -> bool:
        return real.endswith("cpuset.mems")

    refuse_writes(monkeypatch, code, refused)
    with capture_logs() as logs:
        for value in ("1", "0-1", "1"):  # the value wanted changes; the refusal is the same
            assert sysfs.write_if_changed(path, value, "test") is Outcome.FAILED
        monkeypatch.undo()
        refuse_writes(monkeypatch, errno.EINVAL, refused)
        assert sysfs.write_if_changed(path, "1", "test") is Outcome.FAILED
    errors = [e["error"].split(":")[0] for e in logs if e["event"] == "write_failed"]
    assert errors == [errno.errorcode[code], "EINVAL"]
    assert failed(metrics, "cpuset.mems") == 4
