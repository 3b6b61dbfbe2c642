"""Runtime NRI version detection, the valid event mask and the table of applied fields."""

from __future__ import annotations

import pytest

from nri_plugin.wire.runtime_support import (
    APPLIED_FIELDS,
    BASE_FIELDS,
    LEGACY_VALID_EVENTS,
    VALID_EVENTS_0_10,
    RuntimeSupport,
    applied_fields,
    containerd_nri_version,
    parse_version,
    runtime_nri_version,
    valid_events,
)


@pytest.mark.parametrize(("text", "version"), [
    ("v1.7.27", (1, 7, 27)),
    ("1.7.24-0ubuntu1", (1, 7, 24)),
    ("2.1.0+unknown", (2, 1, 0)),
    ("2.4.0-beta.0", (2, 4, 0)),
    ("2.4.0-beta+unknown", (2, 4, 0)),
    ("v0.12", (0, 12, 0)),
    ("2", (2, 0, 0)),
    ("", None),
    ("devel", None),
    ("999999999.0.1", (999999999, 0, 1)),
    # Not a version any runtime has: unparsable, not an error (int() refuses 4,301 digits).
    ("1" * 5000, None),
    ("v1.7." + "9" * 5000, None),
    ("1." + "0" * 10, None),
])
def test_parse_version(text: str, version: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == version


@pytest.mark.parametrize(("containerd", "nri"), [
    ((1, 6, 30), None),
    ((1, 7, 0), (0, 3, 0)),
    ((1, 7, 6), (0, 3, 0)),
    ((1, 7, 7), (0, 4, 0)),
    ((1, 7, 15), (0, 6, 0)),
    ((1, 7, 25), (0, 6, 1)),
    ((1, 7, 26), (0, 8, 0)),
    ((2, 1, 9), (0, 8, 0)),
    ((2, 2, 0), (0, 10, 0)),
    ((2, 2, 7), (0, 11, 0)),
    ((2, 3, 4), (0, 12, 0)),
    ((2, 4, 0), (0, 12, 1)),
])
def test_containerd_nri_table(containerd: tuple[int, int, int],
                              nri: tuple[int, int, int] | None) -> None:
    assert containerd_nri_version(containerd) == nri


def test_absurd_versions_get_the_conservative_answer() -> None:
    for support in (RuntimeSupport.detect("", "containerd", "2." + "9" * 5000),
                    RuntimeSupport.detect("v0." + "1" * 5000, "cri-o", "1.34.0")):
        assert support.valid_events == LEGACY_VALID_EVENTS
        assert support.pod_rpcs is False


def test_stated_nri_version_wins_over_runtime_version() -> None:
    assert runtime_nri_version("v0.12.2", "containerd", "1.7.0") == (0, 12, 2)
    assert runtime_nri_version("", "containerd", "v2.2.3") == (0, 11, 0)
    assert runtime_nri_version("", "cri-o", "1.34.0") is None
    assert runtime_nri_version("", "containerd", "main") is None


def test_valid_events_by_version() -> None:
    assert valid_events(None) == LEGACY_VALID_EVENTS == 0x7FF
    assert valid_events((0, 9, 0)) == 0x7FF
    assert valid_events((0, 10, 0)) == VALID_EVENTS_0_10 == 0x3FFF


# Every row boundary of the containerd table: (last release without, first release with, what
# the second one adds).
CONTAINERD_BOUNDARIES = [
    ("1.7.6", "1.7.7", {"rlimits"}),
    ("1.7.25", "1.7.26", {"oom_score_adj", "pids"}),
    ("2.0.9", "2.1.0", {"cdi_devices"}),
    ("2.1.9", "2.2.0", {"io_priority", "seccomp_policy", "namespaces", "args"}),
    ("2.2.0", "2.2.1", {"clos_id", "rdt_schemata", "sysctl", "scheduler"}),
    ("2.2.7", "2.3.0", {"memory_policy"}),
]


@pytest.mark.parametrize(("before", "after", "added"), CONTAINERD_BOUNDARIES)
def test_every_containerd_row_boundary(before: str, after: str, added: set[str]) -> None:
    old = RuntimeSupport.detect("", "containerd", before).fields
    new = RuntimeSupport.detect("", "containerd", after).fields
    assert new - old == added
    assert not added & old


def test_the_boundaries_cover_every_row() -> None:
    rows = [first for name, first, _ in APPLIED_FIELDS if name == "containerd"]
    firsts = sorted(version for _, after, _ in CONTAINERD_BOUNDARIES
                    if (version := parse_version(after)) is not None)
    assert firsts == rows[1:]


def test_oom_score_adj_from_1_7_26_on_containerd() -> None:
    # Measured: containerd 1.7.27 (NRI v0.8.0) applies oom_score_adj.
    assert RuntimeSupport.detect("", "containerd", "v1.7.27").applies("oom_score_adj")
    assert not RuntimeSupport.detect("", "containerd", "v1.7.25").applies("oom_score_adj")
    assert RuntimeSupport.detect("", "containerd", "1.7.26-0ubuntu1").applies("oom_score_adj")


def test_support_of_containerd_1_7() -> None:
    support = RuntimeSupport.detect("", "containerd", "v1.7.27")
    assert support.nri_version == (0, 8, 0)
    assert support.valid_events == 0x7FF
    assert support.pod_rpcs is False
    assert support.clos_field("auto") == "rdt_class"
    assert support.clos_field("clos_id") is None
    assert support.basis == "containerd 1.7.27"


def test_support_of_containerd_2() -> None:
    support = RuntimeSupport.detect("", "containerd", "2.0.1")
    assert support.applies("oom_score_adj")
    assert not support.applies("clos_id")
    assert support.pod_rpcs is False
    newest = RuntimeSupport.detect("v0.12.2", "containerd", "2.4.0-beta+unknown")
    assert newest.valid_events == 0x3FFF
    assert newest.applies("oom_score_adj")
    assert newest.applies("clos_id")
    assert newest.pod_rpcs
    assert newest.clos_field("auto") == "clos_id"
    assert newest.clos_field("rdt_class") == "rdt_class"


def test_unknown_runtime_follows_its_stated_nri_version() -> None:
    crio = RuntimeSupport.detect("v0.11.0", "cri-o", "1.35.0")
    assert crio.fields == applied_fields("nri", (0, 11, 0))
    assert crio.applies("oom_score_adj")
    assert crio.applies("clos_id")
    assert not crio.applies("memory_policy")
    assert crio.basis == "NRI 0.11.0"
    # Between NRI rows: 0.8 applies what 0.7 added, nothing of 0.10.
    old = RuntimeSupport.detect("v0.8.0", "cri-o", "1.31.0")
    assert old.applies("oom_score_adj")
    assert not old.applies("args")


def test_containerd_with_unparsable_version_follows_its_nri_version() -> None:
    support = RuntimeSupport.detect("v0.12.0", "containerd", "devel")
    assert support.fields == applied_fields("nri", (0, 12, 0))


def test_unknown_and_unparsable_versions_are_conservative() -> None:
    for nri, name, version in [("", "", ""), ("", "containerd", "main"), ("", "cri-o", "1.30"),
                               ("garbage", "cri-o", "x")]:
        support = RuntimeSupport.detect(nri, name, version)
        assert support.fields == BASE_FIELDS, (nri, name, version)
        assert support.valid_events == 0x7FF
        assert not support.applies("oom_score_adj")
        assert support.pod_rpcs is False
        assert support.basis == "unknown runtime version"


def test_future_containerd_applies_everything_known() -> None:
    assert RuntimeSupport.detect("", "containerd", "3.0.0").fields == applied_fields(
        "containerd", (2, 3, 0))
