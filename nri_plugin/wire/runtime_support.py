"""What the connected runtime understands and applies, derived from what it says in Configure.

Two facts decide a runtime's support, each kept as one data table:

* which NRI version it speaks (:data:`CONTAINERD_NRI`): a mask bit it does not know gets the plugin
  rejected at Configure, and its NRI version decides how events arrive;
* which adjustment fields it turns into the OCI spec (:data:`APPLIED_FIELDS`): a runtime applies a
  field from its first release that vendors an NRI whose adaptation copies the field into the
  spec, which for containerd is later than the NRI release that defines it (the table was read
  from the vendored ``runtime-tools/generate`` at each containerd tag and checked on containerd
  1.7.27 and 2.4). A runtime the table does not know (CRI-O, a containerd newer than the table
  with its own NRI version) follows the NRI table: the fields NRI's own adaptation applies from
  the runtime's stated NRI version.

Runtimes from NRI 0.12 state their NRI version; older containerd releases are recognised by their
own version. An unparsable version gets the conservative answer: events 1-11 and the fields every
NRI runtime applies.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Version = tuple[int, int, int]
ClosField = Literal["rdt_class", "clos_id"]

LEGACY_VALID_EVENTS = 0x07FF
"""Events 1-11: every runtime with NRI below 0.10 (and the safe choice when unknown)."""
VALID_EVENTS_0_10 = 0x3FFF
"""Events 1-14: runtimes with NRI 0.10 and later."""

BASE_FIELDS = frozenset({"annotations", "mounts", "env", "hooks", "devices", "memory", "cpu",
                         "unified", "rdt_class"})
"""What every NRI runtime applies (containerd from 1.7.0, NRI from 0.2)."""

CONTAINERD_NRI: tuple[tuple[Version, Version], ...] = (
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
"""(first containerd release, the NRI it ships); each row holds until the next one."""

APPLIED_FIELDS: tuple[tuple[str, Version, frozenset[str]], ...] = (
    ("containerd", (1, 7, 0), BASE_FIELDS),
    ("containerd", (1, 7, 7), frozenset({"rlimits"})),
    ("containerd", (1, 7, 26), frozenset({"oom_score_adj", "pids"})),
    ("containerd", (2, 1, 0), frozenset({"cdi_devices"})),
    ("containerd", (2, 2, 0), frozenset({"io_priority", "seccomp_policy", "namespaces", "args"})),
    ("containerd", (2, 2, 1), frozenset({"clos_id", "rdt_schemata", "sysctl", "scheduler"})),
    ("containerd", (2, 3, 0), frozenset({"memory_policy"})),
    ("nri", (0, 2, 0), BASE_FIELDS),
    ("nri", (0, 4, 0), frozenset({"rlimits"})),
    ("nri", (0, 7, 0), frozenset({"oom_score_adj", "pids", "cdi_devices"})),
    ("nri", (0, 10, 0), frozenset({"io_priority", "seccomp_policy", "namespaces", "args"})),
    ("nri", (0, 11, 0), frozenset({"clos_id", "rdt_schemata", "sysctl", "scheduler"})),
    ("nri", (0, 12, 0), frozenset({"memory_policy"})),
)
"""(runtime, first version, fields it starts applying); fields add up along the rows of one
runtime. The ``nri`` rows are by NRI version, for runtimes not listed by name."""

_VERSION_RE = re.compile(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?")
MAX_VERSION_DIGITS = 9
"""Digits of one part of a version: no release numbers its parts beyond them, and ``int()``
refuses a part of more than 4,300 digits, which a runtime's Configure may carry."""


def parse_version(text: str) -> Version | None:
    """``"v1.7.24-0ubuntu1"``, ``"2.1.0+unknown"``, ``"2.4.0-beta.0"`` -> (major, minor, patch).

    Only the leading numeric part counts: distribution and pre-release suffixes are dropped, so a
    pre-release compares like its release. None when the text has no leading number, or a part
    of more than :data:`MAX_VERSION_DIGITS` digits.
    """
    match = _VERSION_RE.match(text)
    if match is None or any(len(part or "") > MAX_VERSION_DIGITS for part in match.groups()):
        return None
    major, minor, patch = (int(part) if part else 0 for part in match.groups())
    return (major, minor, patch)


def _row_value(rows: Iterable[tuple[Version, Version]], version: Version) -> Version | None:
    found: Version | None = None
    for first, value in rows:
        if version >= first:
            found = value
    return found


def containerd_nri_version(containerd: Version) -> Version | None:
    """The NRI release containerd ``containerd`` ships; None before 1.7 (no NRI protocol)."""
    return _row_value(CONTAINERD_NRI, containerd)


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


def applied_fields(table: str, version: Version | None) -> frozenset[str]:
    """The fields ``table`` (a runtime name or ``nri``) applies at ``version``: the union of its
    rows up to that version. Empty for a version older than the table's first row."""
    if version is None:
        return frozenset()
    fields: set[str] = set()
    for name, first, added in APPLIED_FIELDS:
        if name == table and version >= first:
            fields |= added
    return frozenset(fields)


def _known_runtimes() -> frozenset[str]:
    return frozenset(name for name, _, _ in APPLIED_FIELDS if name != "nri")


@dataclass(frozen=True, slots=True)
class RuntimeSupport:
    """What the connected runtime accepts and applies."""

    nri_version: Version | None
    valid_events: int
    # Adjustment fields the runtime turns into the OCI spec (names as in APPLIED_FIELDS).
    fields: frozenset[str]
    # RunPodSandbox, StartContainer, ... arrive as dedicated RPCs instead of StateChange
    pod_rpcs: bool
    # Which row decided the fields, for the log: "containerd 1.7.26", "NRI 0.8.0", ...
    basis: str

    @classmethod
    def detect(cls, nri_version: str, runtime_name: str, runtime_version: str) -> RuntimeSupport:
        nri = runtime_nri_version(nri_version, runtime_name, runtime_version)
        own = parse_version(runtime_version) if runtime_name in _known_runtimes() else None
        fields = applied_fields(runtime_name, own) if own is not None else frozenset()
        if fields:
            basis = f"{runtime_name} {'.'.join(map(str, own or ()))}"
        elif nri is not None:
            fields = applied_fields("nri", nri)
            basis = f"NRI {'.'.join(map(str, nri))}"
        else:
            # Nothing to go by: what every NRI runtime applies.
            fields, basis = BASE_FIELDS, "unknown runtime version"
        return cls(
            nri_version=nri,
            valid_events=valid_events(nri),
            fields=fields,
            pod_rpcs=nri is not None and nri >= (0, 12, 0),
            basis=basis,
        )

    def applies(self, field: str) -> bool:
        return field in self.fields

    def clos_field(self, configured: str) -> ClosField | None:
        """Adjustment field for the CLOS: ``configured`` unless ``auto``; None if unsupported."""
        if configured == "clos_id":
            return "clos_id" if self.applies("clos_id") else None
        if configured == "rdt_class":
            return "rdt_class" if self.applies("rdt_class") else None
        if self.applies("clos_id"):
            return "clos_id"
        return "rdt_class" if self.applies("rdt_class") else None


UNCONFIGURED = RuntimeSupport.detect("", "", "")
"""Before Configure: nothing is known yet."""
