"""Kernel work done in child processes that are killed at a deadline.

Some writes make the kernel work for long in the writer's context (``memory.force_empty``,
``memory.reclaim``, page migration): a thread doing them could not be abandoned, but a killed
child process interrupts the kernel (it checks for a pending signal between pages). Each child
runs one of the small scripts below with ``python -I -S``, ties its life to the agent's
(``PR_SET_PDEATHSIG``) and reports by its exit status, the errno of what failed.
:class:`Children` starts them, kills one at its deadline and all of them when the agent stops.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import threading

WRITER = (
    "import ctypes, errno, os, sys\n"
    # PR_SET_PDEATHSIG (1) = SIGKILL (9): the writer dies with the agent, whatever kills it.
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9)\n"
    "if os.getppid() != int(sys.argv[3]):\n"
    "    sys.exit(errno.ECHILD)\n"
    "os.nice(int(sys.argv[4]))\n"
    "try:\n"
    "    fd = os.open(sys.argv[1], os.O_WRONLY)\n"
    "    os.write(fd, sys.argv[2].encode('ascii'))\n"
    "except OSError as exc:\n"
    "    sys.exit(exc.errno or 1)\n"
)
"""What a child process runs to write one value, at the niceness it is given: its exit status is
the errno (0: written; ECHILD: the agent was gone before the child could tie its life to it)."""


MOVER = (
    "import ctypes, errno, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.prctl(1, 9)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(errno.ECHILD)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "proc, hot, cool, budget, page, nr = (sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),\n"
    "    int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]))\n"
    "moved = 0\n"
    "def finish(code):\n"
    "    print(moved, flush=True)\n"
    "    sys.exit(code)\n"
    "GONE = (errno.ESRCH, errno.EINVAL)\n"
    "for pid in map(int, sys.argv[8:]):\n"
    "    try:\n"
    "        with open(f'{proc}/{pid}/maps') as f:\n"
    "            ranges = [line.split()[0] for line in f if '[vsyscall]' not in line]\n"
    "    except OSError:\n"
    "        continue\n"
    "    gone = False\n"
    "    for text in ranges:\n"
    "        if gone:\n"
    "            break\n"
    "        lo, hi = (int(x, 16) for x in text.split('-'))\n"
    "        while lo < hi and moved < budget:\n"
    "            n = min(hi, (lo // (512 * page) + 1) * 512 * page) // page - lo // page\n"
    "            pages = (ctypes.c_void_p * n)(*range(lo, lo + n * page, page))\n"
    "            lo += n * page\n"
    "            status = (ctypes.c_int * n)()\n"
    "            if libc.syscall(nr, pid, n, pages, None, status, 0) < 0:\n"
    "                if ctypes.get_errno() in GONE:\n"
    "                    gone = True\n"
    "                    break\n"
    "                finish(ctypes.get_errno())\n"
    "            found = status[:]\n"
    "            if hot not in found:\n"
    "                continue\n"
    "            chosen = [pages[i] for i in range(n) if found[i] == hot][:budget - moved]\n"
    "            k = len(chosen)\n"
    "            if (libc.syscall(nr, pid, k, (ctypes.c_void_p * k)(*chosen),\n"
    "                             (ctypes.c_int * k)(*[cool] * k), (ctypes.c_int * k)(), 4) < 0\n"
    "                    or libc.syscall(nr, pid, n, pages, None, status, 0) < 0):\n"
    "                if ctypes.get_errno() in GONE:\n"
    "                    gone = True\n"
    "                    break\n"
    "                finish(ctypes.get_errno())\n"
    "            now = status[:]\n"
    "            moved += sum(1 for i in range(n) if found[i] == hot and now[i] == cool)\n"
    "        if moved >= budget:\n"
    "            finish(0)\n"
    "finish(0)\n"
)
"""What a child process runs to move at most ``budget`` pages of the given processes from NUMA
node ``hot`` to ``cool`` with move_pages(2): each call asks the kernel where a run of at most
512 pages is (one huge page, aligned as huge pages are, so that none lies across two runs; nodes
NULL), moves those on ``hot`` (MPOL_MF_MOVE_ALL: shared
pages too, as a cpuset.mems change moves them) and asks again where the whole run is: a huge
page moves whole with the first of its pages asked for, which the move's own status does not
show, so a step exceeds its budget by at most one huge page. Small calls keep the child killable
between them, which one migrate_pages(2) or a cpuset.mems write (the kernel moves everything in
one go) is not. It prints the pages it moved and exits with 0 or the errno of a refused call
(EACCES: ``cool`` is not in the process's cpuset). A process that exited meanwhile is skipped:
ESRCH once it is gone, EINVAL while it exits (its memory is already released: the kernel finds
no mm to move pages of)."""

SYS_MOVE_PAGES = {"x86_64": 279, "aarch64": 239}
"""move_pages(2)'s number per architecture (the generic table's 239 on arm64)."""


class Children:
    """The running children of one agent: killed at their deadline, and all of them (with no new
    one started) once :meth:`stop` is called. Shared by every view of one
    :class:`~reconciler.host.sysfs.SysFs` so that stopping reaches them all."""

    def __init__(self) -> None:
        self._running: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self._stopping = False

    def run(self, script: str, argv: list[str], timeout_s: float, name: str
            ) -> tuple[int | None, str, str]:
        """Run ``script`` with ``argv`` in a child killed after ``timeout_s``: its exit status
        (None when killed at the deadline, -1 when it could not start), what it printed, and
        why it failed in words that call it ``name`` ("writer")."""
        with self._lock:
            if self._stopping:
                return -1, "", "not started: the agent is stopping"
            try:
                child = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", script, *argv],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL)
            except OSError as exc:
                return -1, "", f"could not start the {name}: {exc}"
            self._running.add(child)
        try:
            out, _ = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            out, _ = child.communicate()
            return None, out.decode("ascii", "replace"), (
                f"no answer within {timeout_s:g} s: the {name} was killed")
        finally:
            with self._lock:
                self._running.discard(child)
        code = child.returncode
        if code < 0:
            why = (f"the {name} was killed: the agent is stopping" if self._stopping
                   else f"the {name} died of signal {-code}")
        elif code:
            why = f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
        else:
            why = ""
        return code, out.decode("ascii", "replace"), why

    def stop(self) -> int:
        """The agent stops: kill every child still running (the kernel stops its work) instead
        of waiting for it, and start no new one; how many were killed."""
        with self._lock:
            self._stopping = True
            running = list(self._running)
        for child in running:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
        return len(running)
