"""A PSI trigger armed on this machine's kernel when the agent is at its descriptor limit: the
pressure file opened for it is closed again, so arming attempts (one per online pod at every
sync of the pods' triggers) cannot keep the agent at the limit for good. Skipped without root
or PSI."""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path

import pytest

from reconciler.host.pressure import TriggerWatch
from reconciler.host.sysfs import SysFs

PRESSURE = Path("/proc/pressure/memory")
ATTEMPTS = 50


def lowest_free_fd() -> int:
    fd = os.dup(0)
    os.close(fd)
    return fd


def test_a_trigger_that_cannot_get_its_epoll_leaves_no_descriptor_open() -> None:
    if os.geteuid() != 0 or not PRESSURE.exists():
        pytest.skip("needs root and PSI")
    sysfs = SysFs("/")
    TriggerWatch(sysfs, str(PRESSURE), 150_000, 2_000_000).close()  # the kernel takes it
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    free = lowest_free_fd()
    failures: list[int | None] = []
    try:
        # Room for the pressure file's descriptor and none for the epoll instance.
        resource.setrlimit(resource.RLIMIT_NOFILE, (free + 1, hard))
        for _ in range(ATTEMPTS):
            try:
                TriggerWatch(sysfs, str(PRESSURE), 150_000, 2_000_000).close()
            except OSError as exc:
                failures.append(exc.errno)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert failures == [errno.EMFILE] * ATTEMPTS
    assert lowest_free_fd() == free
