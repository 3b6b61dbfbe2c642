"""The page cache of the agent's own code goes back once the code is loaded.

Starting the agent reads some 1,500 files: its modules, its libraries' and their compiled forms.
Python keeps what it loaded, so those pages are never read again, but the kernel charges them
to the memory cgroup of the agent's pod, inside ``kubepods``, and reclaim at ``kubepods``' limit
takes from every cgroup in proportion to its size, not the agent's cold pages first. On a small
node they take room the pods' working sets need: an idle agent's cgroup held 88 MiB with them
and 63 without on cgroup v1, 72-76 and 54-55 in a v2 guest (``bench/agent_idle.py``,
``docs/operations.md``). ``POSIX_FADV_DONTNEED`` on each file drops its clean pages that nothing
maps; the shared libraries' mapped pages stay.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from types import ModuleType


def code_files(modules: Iterable[ModuleType]) -> set[str]:
    """The source and compiled files the modules were loaded from (built-in modules have none)."""
    files: set[str] = set()
    for module in modules:
        for name in ("__file__", "__cached__"):
            path = getattr(module, name, None)
            if isinstance(path, str):
                files.add(path)
    return files


def release_code_pages(modules: Iterable[ModuleType]) -> int:
    """Ask the kernel to drop the cached pages of the modules' files; the number of files it
    was asked for (a file gone or unreadable since it was loaded is passed over)."""
    released = 0
    for path in sorted(code_files(modules)):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            released += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return released
