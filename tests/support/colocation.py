"""What the tests of ``bench/colocation.py``'s parts share: the mark of a test that needs this
machine's real memory cgroups (root and a memory controller), and a container's page cache."""

from __future__ import annotations

from typing import Any

import pytest

from bench.kubelet_node import MIB, KubeletNode, unavailable


def kernel(test: Any) -> Any:
    """A test of the real kernel: here, and once more in a cgroup v1 guest."""
    return pytest.mark.real_kernel(pytest.mark.skipif(
        bool(unavailable()), reason=unavailable() or "available")(test))


def file_pages_mib(node: KubeletNode, rel: str) -> float:
    """The page cache charged to ``rel`` (v1 ``cache``, v2 ``file``), MiB."""
    stat = node.stat(rel)
    return stat.get("cache", stat.get("file", 0)) / MIB
