"""What the tests of ``bench/colocation.py``'s parts share: the mark of a test that needs this
machine's real memory cgroups (root and a memory controller)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.kubelet_node import unavailable


def kernel(test: Any) -> Any:
    """A test of the real kernel: here, and once more in a cgroup v1 guest."""
    return pytest.mark.real_kernel(pytest.mark.skipif(
        bool(unavailable()), reason=unavailable() or "available")(test))
