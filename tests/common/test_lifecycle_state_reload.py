"""A ``[qos]`` reload that lands while a loop's thread builds a snapshot of the node state: the
snapshot is one configuration's, never half the old and half the new, and the next one is the
new configuration's (a mixed snapshot would be served from the cache until the node changes)."""

from __future__ import annotations

from common.state import NodeState, Snapshot
from hooks.model import PodInfo
from hooks.qos_level import QosConfig, resolve_level

OLD = QosConfig()
NEW = QosConfig(default_level="reclaimed_cores")


class ReloadAt:
    """The ``[qos]`` section in force, replaced by a reload at its ``at``-th reading."""

    def __init__(self, at: int) -> None:
        self.current = OLD
        self.readings = 0
        self._at = at

    def __call__(self) -> QosConfig:
        self.readings += 1
        if self.readings == self._at:
            self.current = NEW
        return self.current


def pods(count: int) -> list[PodInfo]:
    return [PodInfo(id=f"s{n}", uid=f"uid-{n}", name=f"p{n}", namespace="ns")
            for n in range(count)]


def levels_match_their_section(snapshot: Snapshot) -> bool:
    return all(view.level == resolve_level(view.info, snapshot.qos).level
               for view in snapshot.pods.values())


def test_a_reload_during_a_snapshot_never_mixes_two_qos_sections() -> None:
    for at in range(1, 8):
        qos = ReloadAt(at)
        state = NodeState(qos=qos)
        state.replace_all(pods(4), [])
        during = state.snapshot()
        assert levels_match_their_section(during), at
        qos.current = NEW  # by now the reload has happened, whenever it landed
        after = state.snapshot()
        assert after.qos is NEW, at
        assert {view.level for view in after.pods.values()} == {"reclaimed_cores"}, at
