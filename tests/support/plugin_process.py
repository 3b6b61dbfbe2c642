"""An out-of-tree eviction plugin in a process of its own (:mod:`tests.support.eviction_plugin`)
serving on a unix socket, for as long as a context lasts."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from tests.support.paths import REPO


@asynccontextmanager
async def plugin_process(socket_path: Path, mode: str, *args: str) -> AsyncIterator[Any]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.eviction_plugin", str(socket_path), mode, *args,
        cwd=REPO, stdout=asyncio.subprocess.PIPE)
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 30)
        assert line == b"ready\n", line
        yield child
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
