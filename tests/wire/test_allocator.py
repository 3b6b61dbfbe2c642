"""Freed large blocks leave the process: a child process allocates and frees, its RSS is read."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

from tests.support.paths import REPO

# Large blocks freed between small survivors: what handling a few big runtime messages does.
WORKLOAD = """
import sys
from nri_plugin.allocator import return_large_blocks

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

if sys.argv[1] == "fixed":
    assert return_large_blocks()
before = rss_kib()
survivors = []
for _ in range(20):
    blocks = [bytes(3 << 20) for _ in range(4)]
    survivors.append(bytes(200))
    survivors.append("x" * 5000)
    del blocks
print((rss_kib() - before) // 1024)
"""


def retained_mib(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", WORKLOAD, mode], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=60)
    return int(done.stdout)


@pytest.mark.skipif(ctypes.util.find_library("c") is None or not sys.platform.startswith("linux"),
                    reason="glibc's mallopt is what is set")
def test_large_blocks_are_returned_once_freed() -> None:
    plain = retained_mib("plain")
    if plain < 4:
        pytest.skip(f"this C library keeps no freed large blocks anyway ({plain} MiB)")
    assert retained_mib("fixed") <= 1
