"""The real-kernel tier: tests marked ``vm`` run inside guests, their outcomes reported on the host.

On the host, ``python -m pytest -m vm`` replaces each selected ``vm`` test with a
:class:`GuestTest` of the same id. The first one of a kind of guest (the marker's keyword
arguments: ``numa``, ``mem_mib``, ``cgroup``) boots that guest once and runs every selected test
of that kind in it with pytest; each guest test then reports what its twin did in the guest: its
failure text, or a failure when it was skipped there (a test of the tier that cannot run in its
guest is a bug of the tier) or never ran. Inside a guest (``NRIQOS_VM`` set) the tests run
as they are, and each report is written to ``$NRIQOS_VM_ARTIFACTS/results.jsonl``.

``vm(host=True)`` marks a test of the harness itself: it runs on the host, with the tier.

``real_kernel`` marks a test of this machine's kernel that must also run in a cgroup v1 guest:
it is parametrized ``host`` (runs here, as before) and ``v1-guest`` (marked ``vm``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.vm.image import Unavailable
from tests.vm.machine import NO_STATUS, Guest, Result, run

REPO = Path(__file__).resolve().parents[2]
RESULTS = "results.jsonl"
# A guest runs all its tests under one deadline; each test inside still has pytest-timeout's own.
GUEST_DEADLINE_S = 1500.0
KERNEL_PARAM = "kernel_under_test"


def in_guest() -> bool:
    return bool(os.environ.get("NRIQOS_VM"))


def guest_of(item: pytest.Item) -> Guest:
    marker = item.get_closest_marker("vm")
    assert marker is not None
    # The tier's guests always have a scratch disk: page cache experiments need a real
    # filesystem (tmpfs pages are not file cache), and TMPDIR points there.
    return Guest(disk=True, **marker.kwargs)


def configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vm(numa=1, mem_mib=2048, cgroup='v2'): runs in a guest "
                                       "with a real kernel (python -m pytest -m vm); "
                                       "vm(host=True): a test of the tier's harness itself, "
                                       "run on the host with the tier")
    config.addinivalue_line("markers", "real_kernel: a test of this machine's kernel that runs "
                                       "once more in a cgroup v1 guest")
    config.stash[_RUNS] = {}


def generate(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("real_kernel") is None:
        return
    metafunc.parametrize(KERNEL_PARAM, [
        pytest.param("host", id="host"),
        pytest.param("v1-guest", id="v1-guest", marks=pytest.mark.vm(cgroup="v1")),
    ], indirect=True)


def replace_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On the host, each selected ``vm`` test becomes the report of its run in a guest."""
    if in_guest():
        return
    for index, item in enumerate(items):
        marker = item.get_closest_marker("vm")
        if marker is not None and not marker.kwargs.get("host") and item.parent is not None:
            items[index] = GuestTest.from_parent(item.parent, name=item.name, twin=item)


def host_markers(twin: list[pytest.Mark]) -> list[pytest.Mark]:
    """The markers of a test's stand-in on the host: the test's own, but its timeout. The
    first stand-in of a guest boots it and waits for all of that guest's tests, so the guest's
    own deadline bounds the wait and pytest-timeout must not cut it short with one test's
    budget (each test keeps its own timeout inside the guest)."""
    deadline = pytest.mark.timeout(GUEST_DEADLINE_S + 120).mark
    return [deadline, *(mark for mark in twin if mark.name != "timeout")]


class GuestTest(pytest.Item):
    def __init__(self, *, twin: pytest.Item, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.guest = guest_of(twin)
        self.path_and_line = twin.reportinfo()
        self.own_markers.extend(host_markers(twin.own_markers))

    def runtest(self) -> None:
        runs: dict[Guest, GuestRun] = self.config.stash[_RUNS]
        if self.guest not in runs:
            wanted = [i.nodeid for i in self.session.items
                      if isinstance(i, GuestTest) and i.guest == self.guest]
            runs[self.guest] = GuestRun.start(self.guest, wanted)
        runs[self.guest].verdict(self.nodeid)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> Any:
        if isinstance(excinfo.value, GuestFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        path, line, _ = self.path_and_line
        return path, line, f"{self.name} in a guest ({self.guest.describe()})"


class GuestFailure(Exception):
    """What a guest says of a test that did not pass there."""


class GuestRun:
    """One guest's pytest run and what it reported, by test id and phase."""

    def __init__(self, result: Result | None, error: str = "") -> None:
        self.result = result
        self.error = error
        self.reports: dict[str, list[dict[str, Any]]] = {}
        for line in (result.artifacts.get(RESULTS, "") if result else "").splitlines():
            report = json.loads(line)
            self.reports.setdefault(report["nodeid"], []).append(report)

    @classmethod
    def start(cls, guest: Guest, nodeids: list[str]) -> GuestRun:
        print(f"\nnriqos-vm: booting a guest ({guest.describe()}) for {len(nodeids)} test(s)",
              file=sys.stderr, flush=True)
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "vm",
                   "-o", "addopts=", *nodeids]
        try:
            result = run(guest, command, cwd=REPO, timeout_s=GUEST_DEADLINE_S, echo=None)
        except Unavailable as exc:
            return cls(None, f"no guest could be run: {exc}")
        print(f"nriqos-vm: guest finished in {result.seconds:.0f} s (status {result.status})",
              file=sys.stderr, flush=True)
        return cls(result)

    def verdict(self, nodeid: str) -> None:
        if self.result is None:
            raise GuestFailure(self.error)
        reports = self.reports.get(nodeid)
        if not reports:
            why = ("the guest did not finish" if self.result.status == NO_STATUS
                   else f"pytest exited {self.result.status}")
            raise GuestFailure(f"the test did not run in the guest ({why}); its output:\n"
                               + _tail(self.result.output) + "\nconsole:\n"
                               + _tail(self.result.console, 15))
        for report in reports:
            if report["outcome"] == "failed":
                raise GuestFailure(f"failed in the guest ({report['when']}):\n"
                                   + report["longrepr"])
            if report["outcome"] == "skipped":
                raise GuestFailure("skipped in the guest, where every test of the tier must run: "
                                   + report["longrepr"])


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def record(report: pytest.TestReport) -> None:
    """Inside a guest: one line per phase for the host to read."""
    directory = os.environ.get("NRIQOS_VM_ARTIFACTS")
    if not in_guest() or not directory:
        return
    if report.when != "call" and report.outcome == "passed":
        return
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "longrepr": str(report.longrepr) if report.longrepr else "",
            "duration": report.duration}
    with open(Path(directory) / RESULTS, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def kernel_under_test(request: pytest.FixtureRequest) -> str:
    """The ``real_kernel`` parameter (``host`` or ``v1-guest``); ``host`` where not parametrized."""
    return str(getattr(request, "param", "host"))


_RUNS = pytest.StashKey[dict[Guest, GuestRun]]()
