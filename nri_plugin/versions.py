"""What the connected runtime understands, derived from what it says in Configure.

The runtime's NRI version decides which event-mask bits it accepts (a bit it does not know gets
the plugin rejected at Configure) and which adjustment fields it applies. Runtimes from NRI 0.12
send their NRI version; older containerd releases are recognised by their own version through the
table of which NRI each containerd release ships.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Version = tuple[int, int, int]
ClosField = Literal["rdt_class", "clos_id"]

LEGACY_VALID_EVENTS = 0x07FF
"""Events 1-11: every runtime with NRI below 0.10 (and the safe choice when unknown)."""
VALID_EVENTS_0_10 = 0x3FFF
"""Events 1-14: runtimes with NRI 0.10 and later."""

# (first containerd release, NRI it ships); each row holds until the next one.
_CONTAINERD_NRI: tuple[tuple[Version, Version], ...] = (
    ((1, 7, 0), (0, 3, 0)),
    ((1, 7, 7), (0, 4, 0)),
    ((1, 7, 14), (0, 6, 0)),
    ((1, 7, 16), (0, 6, 1)),
    ((1, 7, 26), (0, 8, 0)),
    ((2, 2, 0), (0, 10, 0)),
    ((2, 2, 1), (0, 11, 0)),
    ((2, 3, 0), (0, 12, 0)),
    ((2, 4, 0), (0, 12, 1)),
)

_VERSION_RE = re.compile(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def parse_version(text: str) -> Version | None:
    """``"v1.7.24-0ubuntu1"``, ``"2.1.0+unknown"``, ``"2.4.0-beta.0"`` -> (major, minor, patch).

    Only the leading numeric part counts: distribution and pre-release suffixes are dropped, so a
    pre-release compares like its release. None when the text has no leading number.
    """
    match = _VERSION_RE.match(text)
    if match is None:
        return None
    major, minor, patch = (int(part) if part else 0 for part in match.groups())
    return (major, minor, patch)


def containerd_nri_version(containerd: Version) -> Version | None:
    """The NRI release containerd ``containerd`` ships; None before 1.7 (no NRI protocol)."""
    found: Version | None = None
    for first, nri in _CONTAINERD_NRI:
        if containerd >= first:
            found = nri
    return found


def runtime_nri_version(
    nri_version: str, runtime_name: str, runtime_version: str
) -> Version | None:
    """The runtime's NRI version: its own statement, else known from containerd's version."""
    if nri_version:
        return parse_version(nri_version)
    if runtime_name == "containerd":
        containerd = parse_version(runtime_version)
        if containerd is not None:
            return containerd_nri_version(containerd)
    return None


def valid_events(nri: Version | None) -> int:
    """Mask of the events the runtime accepts in ConfigureResponse."""
    if nri is not None and nri >= (0, 10, 0):
        return VALID_EVENTS_0_10
    return LEGACY_VALID_EVENTS


@dataclass(frozen=True, slots=True)
class RuntimeCapabilities:
    """What the connected runtime accepts and applies."""

    nri_version: Version | None
    # containerd's own version; None for other runtimes or an unparsable version
    containerd_version: Version | None
    valid_events: int
    # ContainerAdjustment.linux.oom_score_adj is applied
    oom_score_adj: bool
    # linux.resources.rdt_class is applied (as the OCI intelRdt.closID)
    rdt_class: bool
    # linux.rdt.clos_id is applied
    clos_id: bool
    # RunPodSandbox, StartContainer, ... arrive as dedicated RPCs instead of StateChange
    pod_rpcs: bool

    @classmethod
    def detect(
        cls, nri_version: str, runtime_name: str, runtime_version: str
    ) -> RuntimeCapabilities:
        nri = runtime_nri_version(nri_version, runtime_name, runtime_version)
        containerd = parse_version(runtime_version) if runtime_name == "containerd" else None

        def nri_at_least(*version: int) -> bool:
            return nri is not None and nri >= version

        if containerd is not None:
            # containerd applies fields later than the NRI release that defines them.
            oom = containerd >= (2, 0, 0)
            rdt_class = containerd >= (1, 7, 0)
        else:
            oom = nri_at_least(0, 7, 0)
            rdt_class = nri is not None
        return cls(
            nri_version=nri,
            containerd_version=containerd,
            valid_events=valid_events(nri),
            oom_score_adj=oom,
            rdt_class=rdt_class,
            clos_id=nri_at_least(0, 11, 0),
            pod_rpcs=nri_at_least(0, 12, 0),
        )

    def clos_field(self, configured: str) -> ClosField | None:
        """Adjustment field for the CLOS: ``configured`` unless ``auto``; None if unsupported."""
        if configured == "clos_id":
            return "clos_id" if self.clos_id else None
        if configured == "rdt_class":
            return "rdt_class" if self.rdt_class else None
        if self.clos_id:
            return "clos_id"
        return "rdt_class" if self.rdt_class else None
