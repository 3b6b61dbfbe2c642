"""``bench/wakeups.py`` runs end to end and prints a cost for every way of sleeping."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.paths import REPO


def test_every_way_of_sleeping_is_measured() -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench/wakeups.py"), "--period", "0.01",
                           "--seconds", "0.2", "--rounds", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = re.findall(r"^  (.+?) +(\d+) us  \((\d+)-(\d+)\)$", done.stdout, re.MULTILINE)
    assert [name for name, *_ in rows] == ["asyncio.sleep", "sleep_until, one event",
                                          "sleep_until, two events"]
    for _name, median, low, high in rows:
        assert int(low) <= int(median) <= int(high)
