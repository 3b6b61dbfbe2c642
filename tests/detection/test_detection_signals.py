"""The readings board: latest reading per detector and scope, change notifications."""

from __future__ import annotations

from reconciler.detection.signals import NODE, Board, Level, Reading, numa_scope


def reading(detector: str, scope: str, level: Level, value: float = 1.0) -> Reading:
    return Reading(detector, scope, level, value, 2.0, "bytes")


def test_publish_replaces_a_detectors_readings_and_keeps_the_others() -> None:
    board = Board()
    board.publish("free", [reading("free", NODE, Level.LOW), reading("free", numa_scope(0),
                                                                      Level.NONE)])
    board.publish("psi", [reading("psi", NODE, Level.HIGH)])
    assert {r.key for r in board.current()} == {("free", "node"), ("free", "numa:0"),
                                                ("psi", "node")}
    board.publish("free", [reading("free", NODE, Level.MEDIUM)])
    assert {r.key: r.level for r in board.current()} == {("free", "node"): Level.MEDIUM,
                                                         ("psi", "node"): Level.HIGH}
    assert board.worst() is Level.HIGH


def test_subscribers_hear_level_changes_only() -> None:
    board, calls = Board(), []
    stop = board.subscribe(lambda: calls.append(1))
    board.publish("free", [reading("free", NODE, Level.LOW, 1.0)])
    board.publish("free", [reading("free", NODE, Level.LOW, 1.5)])  # same level: quiet
    board.publish("free", [])  # the scope is gone: a change
    assert calls == [1, 1]
    stop()
    board.publish("free", [reading("free", NODE, Level.HIGH)])
    assert calls == [1, 1]


def test_a_subscriber_may_unsubscribe_itself_while_called() -> None:
    board, calls = Board(), []

    def once() -> None:
        calls.append("once")
        stop()  # from inside the call: no deadlock on the board's lock

    stop = board.subscribe(once)
    board.subscribe(lambda: calls.append("always"))
    board.publish("free", [reading("free", NODE, Level.LOW)])
    board.publish("free", [reading("free", NODE, Level.HIGH)])
    assert calls == ["once", "always", "always"]
    stop()  # a second time: harmless


def test_worst_of_nothing_is_none_and_unknown_is_below_none() -> None:
    board = Board()
    assert board.worst() is Level.NONE
    board.publish("free", [reading("free", NODE, Level.UNKNOWN)])
    assert board.worst() is Level.UNKNOWN
    assert Level.UNKNOWN < Level.NONE < Level.LOW < Level.MEDIUM < Level.HIGH
