"""Large blocks of memory go back to the system as soon as they are freed.

glibc's malloc serves a block of at least its mmap threshold (128 KiB to begin with) with a
mapping of its own, unmapped when the block is freed. But each time such a block is freed it
raises the threshold to that block's size (up to 32 MiB), and blocks under the new threshold then
come from the heap, which keeps its free space once anything small was allocated after them. The
agent reads, copies and decodes every runtime message: after one message of a few MiB, every
later large message would stay in the process's RSS for good (megabytes per message size seen).
With the threshold fixed (at 1 MiB), a large message's memory is returned when the message is
handled.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number for the mmap threshold."""
MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks this large or larger get a mapping of their own. Above the 256 KiB buffer asyncio
receives into on every read (mapping that anew each time costs page faults: about 40 us of CPU
per request measured), below any runtime message large enough to matter."""


def return_large_blocks() -> bool:
    """Fix the mmap threshold at :data:`MMAP_THRESHOLD_BYTES`; False where the C library has no
    such setting (the allocator then behaves as it would anyway)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
