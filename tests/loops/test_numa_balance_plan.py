"""NUMA balance's planner: hot and cool nodes, largest first, budgets, rate limit, recovery,
and when it reads the candidates."""

from __future__ import annotations

from collections.abc import Sequence

from nri_plugin.config.schema import Config
from reconciler.host.numa import NumaNode
from reconciler.loops.numa_balance import Candidate, Watermark, next_step_at, plan_step
from tests.support.fakesys import GIB, MIB

MARK = Watermark(4 * GIB, 1.0, None)  # every node's watermark: 4 GiB
OFFLINE = "reclaimed_cores"
ONLINE = "shared_cores"
BOTH = frozenset({0, 1})


def node(id_: int, free: int) -> NumaNode:
    return NumaNode(id_, free, 64 * GIB, 0)


def plan(nodes: Sequence[NumaNode], candidates: Sequence[Candidate], *,
         step: int = 64 * MIB, rate: int = 128 * MIB, last: tuple[float, int] | None = None,
         now: float = 100.0, min_step: int = 16 * MIB,
         ) -> tuple[tuple[str, int, int, int] | None, str]:
    decision = plan_step(nodes, lambda: candidates, MARK, step_bytes=step, rate_bytes_per_s=rate,
                         last=last, now=now, min_step_bytes=min_step)
    if decision.step is None:
        return None, decision.reason
    s = decision.step
    return (s.candidate.container, s.hot, s.cool, s.asked_bytes), decision.reason


def cand(container: str, on_0: int, *, pod: str | None = None, level: str = OFFLINE,
         mems: frozenset[int] = BOTH) -> Candidate:
    return Candidate(pod or container, container, level, {0: on_0, 1: 0}, mems)


# -- the planner ---------------------------------------------------------------------------------

def test_hot_is_the_node_furthest_under_and_cool_the_one_with_most_headroom() -> None:
    nodes = [node(0, 3 * GIB), node(1, 6 * GIB), node(2, 2 * GIB), node(3, 9 * GIB)]
    c = Candidate("p", "a", OFFLINE, {0: GIB, 2: GIB}, frozenset({0, 1, 2, 3}))
    step, _ = plan(nodes, [c])
    assert step == ("a", 2, 3, 64 * MIB)


def test_largest_pod_first_then_its_largest_container() -> None:
    nodes = [node(0, 3 * GIB), node(1, 20 * GIB)]
    # pod p holds 300 MiB on node 0 in two containers, pod q 250 MiB in one
    candidates = [cand("p1", 100 * MIB, pod="p"), cand("p2", 200 * MIB, pod="p"),
                  cand("q1", 250 * MIB, pod="q")]
    step, _ = plan(nodes, candidates)
    assert step is not None
    assert step[0] == "p2"


def test_a_step_asks_for_the_budget_or_what_the_container_holds_whichever_is_less() -> None:
    nodes = [node(0, 3 * GIB), node(1, 20 * GIB)]
    assert plan(nodes, [cand("a", 64 * MIB + 4096)])[0] == ("a", 0, 1, 64 * MIB)
    assert plan(nodes, [cand("a", 64 * MIB - 4096)])[0] == ("a", 0, 1, 64 * MIB - 4096)


def test_never_more_than_half_what_the_cool_node_has_above_its_watermark() -> None:
    nodes = [node(0, 3 * GIB), node(1, 4 * GIB + 10 * MIB)]
    assert plan(nodes, [cand("a", GIB)], min_step=MIB)[0] == ("a", 0, 1, 5 * MIB)
    nodes = [node(0, 3 * GIB), node(1, 4 * GIB + 128 * MIB)]
    assert plan(nodes, [cand("a", GIB)])[0] == ("a", 0, 1, 64 * MIB)
    nodes = [node(0, 3 * GIB), node(1, 4 * GIB + 126 * MIB)]
    assert plan(nodes, [cand("a", GIB)])[0] == ("a", 0, 1, 63 * MIB)
    # exactly at its watermark: no headroom, nothing moves
    step, reason = plan([node(0, 3 * GIB), node(1, 4 * GIB)], [cand("a", GIB)])
    assert step is None
    assert reason == "no NUMA node has headroom"


def test_no_step_while_half_the_cool_nodes_headroom_is_under_the_smallest_step() -> None:
    assert Config().numa_balance.min_step_bytes == 16 * MIB
    # headroom 32 MiB: a step of exactly 16 MiB
    nodes = [node(0, 3 * GIB), node(1, 4 * GIB + 32 * MIB)]
    assert plan(nodes, [cand("a", GIB)])[0] == ("a", 0, 1, 16 * MIB)
    # a page less: both nodes are short, steps halving each time would only cost page walks
    nodes = [node(0, 3 * GIB), node(1, 4 * GIB + 32 * MIB - 8192)]
    step, reason = plan(nodes, [cand("a", GIB)])
    assert step is None
    assert reason == (f"node 1 has {32 * MIB - 8192} bytes above its watermark: half of it "
                      f"is under a step of {16 * MIB} bytes")
    # what a container has left on the hot node still moves, however little room there is
    nodes = [node(0, 3 * GIB), node(1, 4 * GIB + 2 * MIB)]
    assert plan(nodes, [cand("a", MIB)])[0] == ("a", 0, 1, MIB)
    assert plan(nodes, [cand("a", MIB + 4096)])[0] is None


def test_no_step_once_the_hot_node_is_back_at_its_watermark() -> None:
    step, reason = plan([node(0, 4 * GIB), node(1, 20 * GIB)], [cand("a", GIB)])
    assert step is None
    assert reason == "no NUMA node is under its watermark"
    assert plan([node(0, 4 * GIB - 4096), node(1, 20 * GIB)], [cand("a", GIB)])[0] == (
        "a", 0, 1, 64 * MIB)


def test_the_candidates_are_read_only_when_a_step_could_be_taken() -> None:
    calls: list[int] = []

    def candidates() -> list[Candidate]:
        calls.append(1)
        return [cand("a", GIB)]

    def asked(nodes: Sequence[NumaNode]) -> int:
        calls.clear()
        plan_step(nodes, candidates, MARK, step_bytes=64 * MIB, rate_bytes_per_s=128 * MIB,
                  last=None, now=100.0, min_step_bytes=16 * MIB)
        return len(calls)

    # exactly at the watermark is not under it; a page less is
    assert asked([node(0, 4 * GIB), node(1, 20 * GIB)]) == 0
    assert asked([node(0, 4 * GIB - 4096), node(1, 20 * GIB)]) == 1
    # under it, but no node with headroom to take the pages: nothing to read them for
    assert asked([node(0, 3 * GIB), node(1, 4 * GIB)]) == 0
    assert asked([node(0, 3 * GIB), node(1, 4 * GIB + 4096)]) == 1


def test_the_rate_limit_spaces_steps_by_the_bytes_they_moved() -> None:
    nodes = [node(0, 3 * GIB), node(1, 20 * GIB)]
    last = (100.0, 64 * MIB)
    assert next_step_at(100.0, 64 * MIB, 128 * MIB) == 100.5
    step, reason = plan(nodes, [cand("a", GIB)], last=last, now=100.499)
    assert step is None
    assert reason == "rate limit: next step in 0.001 s"
    assert plan_step(nodes, lambda: [cand("a", GIB)], MARK, step_bytes=64 * MIB,
                     rate_bytes_per_s=128 * MIB, last=last, now=100.499,
                     min_step_bytes=16 * MIB).retry_at == 100.5
    assert plan(nodes, [cand("a", GIB)], last=last, now=100.5)[0] == ("a", 0, 1, 64 * MIB)
    # a step that moved nothing does not hold the next one back
    assert plan(nodes, [cand("a", GIB)], last=(100.0, 0), now=100.0)[0] is not None


def test_online_pods_are_never_chosen() -> None:
    nodes = [node(0, 3 * GIB), node(1, 20 * GIB)]
    step, _ = plan(nodes, [cand("web", 2 * GIB, level=ONLINE), cand("batch", 10 * MIB)])
    assert step == ("batch", 0, 1, 10 * MIB)
    for level in (ONLINE, "dedicated_cores", "system_cores"):
        step, reason = plan(nodes, [cand("x", GIB, level=level)])
        assert step is None
        assert reason == "no reclaimed pod holds memory on the nodes under their watermark"


def test_a_container_no_longer_allowed_on_the_hot_node_is_left() -> None:
    nodes = [node(0, 3 * GIB), node(1, 20 * GIB)]
    step, _ = plan(nodes, [cand("a", GIB, mems=frozenset({1}))])
    assert step is None
