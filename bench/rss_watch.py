"""The agent's resident memory during one case of the hostile-runtime benchmark."""

from __future__ import annotations

import threading

from tests.support.raw_runtime import reset_peak, status_kib


class RssWatch:
    """The agent's RSS: before a case, and its peak during the case."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        before = status_kib(self.pid, "VmRSS")
        # The kernel's high-water mark from here is this case's peak (sampling alone can miss a
        # short one).
        reset_peak(self.pid)
        self._peak = before
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return before

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, status_kib(self.pid, "VmRSS"))

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return max(self._peak, status_kib(self.pid, "VmHWM"))
