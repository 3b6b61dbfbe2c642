"""The kernel refusing some writes, as a test needs it: through every view of a tree, since
each :class:`~reconciler.host.sysfs.SysFs` writes through the same one function."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from reconciler.host.sysfs import SysFs


def refuse_writes(monkeypatch: pytest.MonkeyPatch, code: int,
                  refused: Callable[[str, bytes], bool]) -> None:
    """Writes for which ``refused(real_path, data)`` is true fail with ``code`` (an errno)."""
    write_once = SysFs._write_once

    def refuse(real: str, data: bytes, create: bool) -> None:
        if refused(real, data):
            raise OSError(code, os.strerror(code))
        write_once(real, data, create)

    monkeypatch.setattr(SysFs, "_write_once", staticmethod(refuse))
