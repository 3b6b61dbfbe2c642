"""Runtime NRI version detection, the valid event mask and the capability table."""

from __future__ import annotations

import pytest

from nri_plugin.versions import (
    LEGACY_VALID_EVENTS,
    VALID_EVENTS_0_10,
    RuntimeCapabilities,
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


def test_stated_nri_version_wins_over_runtime_version() -> None:
    assert runtime_nri_version("v0.12.2", "containerd", "1.7.0") == (0, 12, 2)
    assert runtime_nri_version("", "containerd", "v2.2.3") == (0, 11, 0)
    assert runtime_nri_version("", "cri-o", "1.34.0") is None
    assert runtime_nri_version("", "containerd", "main") is None


def test_valid_events_by_version() -> None:
    assert valid_events(None) == LEGACY_VALID_EVENTS == 0x7FF
    assert valid_events((0, 9, 0)) == 0x7FF
    assert valid_events((0, 10, 0)) == VALID_EVENTS_0_10 == 0x3FFF


def test_capabilities_of_containerd_1_7() -> None:
    caps = RuntimeCapabilities.detect("", "containerd", "v1.7.27")
    assert caps.nri_version == (0, 8, 0)
    assert caps.valid_events == 0x7FF
    assert (caps.oom_score_adj, caps.rdt_class, caps.clos_id, caps.pod_rpcs) == (
        False, True, False, False)
    assert caps.clos_field("auto") == "rdt_class"
    assert caps.clos_field("clos_id") is None


def test_capabilities_of_containerd_2() -> None:
    caps = RuntimeCapabilities.detect("", "containerd", "2.0.1")
    assert (caps.oom_score_adj, caps.clos_id, caps.pod_rpcs) == (True, False, False)
    newest = RuntimeCapabilities.detect("v0.12.2", "containerd", "2.4.0-beta+unknown")
    assert newest.valid_events == 0x3FFF
    assert (newest.oom_score_adj, newest.clos_id, newest.pod_rpcs) == (True, True, True)
    assert newest.clos_field("auto") == "clos_id"
    assert newest.clos_field("rdt_class") == "rdt_class"


def test_capabilities_of_unknown_runtime_are_conservative() -> None:
    caps = RuntimeCapabilities.detect("", "", "")
    assert caps.valid_events == 0x7FF
    assert (caps.oom_score_adj, caps.clos_id, caps.pod_rpcs) == (False, False, False)
    other = RuntimeCapabilities.detect("v0.11.0", "cri-o", "1.35.0")
    assert (other.oom_score_adj, other.rdt_class, other.clos_id) == (True, True, True)
