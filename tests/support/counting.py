"""A :class:`SysFs` that counts the files it reads and the directories it lists: the tests of
how much a loop reads."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

from common.audit import AuditLog
from reconciler.host.sysfs import SysFs


class CountingSysFs(SysFs):
    def __init__(self, root: str | os.PathLike[str], audit: AuditLog, *,
                 observe: Callable[[], bool] | None = None) -> None:
        super().__init__(root, audit, observe=observe)
        self.reads: Counter[str] = Counter()
        self.listed: Counter[str] = Counter()

    def read(self, path: str) -> str | None:
        self.reads[path] += 1
        return super().read(path)

    def list_dir(self, path: str) -> list[str]:
        self.listed[path] += 1
        return super().list_dir(path)

    def clear(self) -> None:
        self.reads.clear()
        self.listed.clear()
