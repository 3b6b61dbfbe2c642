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

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter numbers."""
MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks this large or larger get a mapping of their own. Above the 256 KiB buffer asyncio
receives into on every read (mapping that anew each time costs page faults: about 40 us of CPU
per request measured), below any runtime message large enough to matter."""
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
"""Free space at the top of the heap kept for reuse rather than given back."""


def return_large_blocks() -> bool:
    """Fix the mmap threshold at :data:`MMAP_THRESHOLD_BYTES`; False where the C library has no
    such setting (the allocator then behaves as it would anyway)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # Fixing one threshold stops glibc from moving the other: the trim threshold is set where
    # it would have gone (twice the mmap threshold), else the heap's top would be given back and
    # taken again around every read (two brk calls per request).
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
