"""``nri_qos_host_writes_total`` counts every write the agent makes to a system file, by file
name and outcome (docs/operations.md): the bounded writes of drop cache and offloading
(``memory.reclaim``, ``memory.force_empty``, written by a child process) as much as the others,
in enforce mode as they are counted ``observed`` in observe mode."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.metrics import Metrics
from reconciler.host.children import Children
from reconciler.host.sysfs import Outcome, SysFs
from tests.support.fakesys import write

CGROUP = "/sys/fs/cgroup/kubepods/besteffort/pod1"


def metered(root: Path, observe: bool = False,
            children: Children | None = None) -> tuple[SysFs, Metrics]:
    metrics = Metrics()
    sysfs = SysFs(root, AuditLog(MemoryAuditSink()), children=children).metered(
        metrics).observing(lambda: observe)
    return sysfs, metrics


class Answering(Children):
    """A child that ends with ``code`` without running: what the kernel answers that a plain
    file cannot (``memory.reclaim``'s EAGAIN, a page move)."""

    def __init__(self, code: int, out: str = "") -> None:
        super().__init__()
        self._code, self._out = code, out

    def run(self, script: str, argv: list[str], timeout_s: float, name: str
            ) -> tuple[int | None, str, str]:
        why = f"{errno.errorcode[self._code]}: {os.strerror(self._code)}" if self._code else ""
        return self._code, self._out, why


def counted(metrics: Metrics, file: str, outcome: str) -> float:
    return metrics.registry.get_sample_value(
        "nri_qos_host_writes_total", {"file": file, "outcome": outcome}) or 0.0


@pytest.mark.parametrize("observe", [True, False])
def test_a_bounded_write_is_counted_in_either_mode(tmp_path: Path, observe: bool) -> None:
    write(tmp_path / CGROUP.lstrip("/") / "memory.reclaim", "")
    sysfs, metrics = metered(tmp_path, observe)
    outcome, _ = sysfs.write_bounded(f"{CGROUP}/memory.reclaim", "4096", 10.0)
    expected = Outcome.OBSERVED if observe else Outcome.WRITTEN
    assert outcome is expected
    assert counted(metrics, "memory.reclaim", expected.value) == 1


def test_a_bounded_write_to_a_removed_cgroup_is_counted_gone(tmp_path: Path) -> None:
    (tmp_path / CGROUP.lstrip("/")).mkdir(parents=True)
    sysfs, metrics = metered(tmp_path)
    outcome, _ = sysfs.write_bounded(f"{CGROUP}/gone/memory.reclaim", "4096", 10.0)
    assert outcome is Outcome.GONE
    assert counted(metrics, "memory.reclaim", "gone") == 1


def test_a_bounded_write_into_a_directory_is_counted_failed(tmp_path: Path) -> None:
    (tmp_path / CGROUP.lstrip("/") / "memory.force_empty").mkdir(parents=True)
    sysfs, metrics = metered(tmp_path)
    outcome, why = sysfs.write_bounded(f"{CGROUP}/memory.force_empty", "0", 10.0)
    assert outcome is Outcome.FAILED, why
    assert why.startswith(errno.errorcode[errno.EISDIR]), why
    assert counted(metrics, "memory.force_empty", "failed") == 1


def test_a_bounded_write_killed_at_its_deadline_is_counted_timeout(tmp_path: Path) -> None:
    # A FIFO without a reader: opening it for writing waits until the writer is killed.
    fifo = tmp_path / CGROUP.lstrip("/") / "memory.reclaim"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    sysfs, metrics = metered(tmp_path)
    outcome, _ = sysfs.write_bounded(f"{CGROUP}/memory.reclaim", "4096", 0.5)
    assert outcome is Outcome.TIMEOUT
    assert counted(metrics, "memory.reclaim", "timeout") == 1


def test_a_short_reclaim_is_counted_written_not_failed(tmp_path: Path) -> None:
    sysfs, metrics = metered(tmp_path, children=Answering(errno.EAGAIN))
    outcome, why = sysfs.write_bounded(f"{CGROUP}/memory.reclaim", "4096", 10.0)
    assert (outcome, why.split(":")[0]) == (Outcome.FAILED, "EAGAIN")
    assert counted(metrics, "memory.reclaim", "written") == 1
    assert counted(metrics, "memory.reclaim", "failed") == 0


@pytest.mark.parametrize(("code", "outcome"), [(0, Outcome.WRITTEN),
                                               (errno.EPERM, Outcome.FAILED)])
def test_a_page_move_is_counted_as_observe_mode_counts_it(tmp_path: Path, code: int,
                                                          outcome: Outcome) -> None:
    sysfs, metrics = metered(tmp_path, children=Answering(code, "16"))
    assert sysfs.move_pages_bounded([42], 0, 1, 1 << 20, 10.0)[0] is outcome
    assert counted(metrics, "move_pages", outcome.value) == 1
    observing, observed = metered(tmp_path, observe=True)
    assert observing.move_pages_bounded([42], 0, 1, 1 << 20, 10.0)[0] is Outcome.OBSERVED
    assert counted(observed, "move_pages", "observed") == 1
