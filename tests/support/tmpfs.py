"""A tmpfs mounted for one test (root only; the test is skipped where mounting is refused)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    """``where`` (made if needed) with a tmpfs of ``options`` on it, unmounted at the end."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
