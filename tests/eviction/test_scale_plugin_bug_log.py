"""An in-tree eviction plugin that raises at every round (a round a second under pressure, every
ten seconds when quiet, for as long as the condition that trips it lasts): its traceback is
logged once per streak of failures, as its audit record is, not at every round."""

from __future__ import annotations

from collections.abc import Sequence

from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from reconciler.eviction.api import ActivePod, EvictPods, MetType, ThresholdMet, TopPods
from reconciler.eviction.calls import PluginCalls


class Tripping:
    """A plugin whose ThresholdMet raises while ``broken``."""

    name = "tripping"

    def __init__(self) -> None:
        self.broken = True

    async def threshold_met(self) -> ThresholdMet:
        if self.broken:
            raise KeyError("a reading it did not expect")
        return ThresholdMet(MetType.NOT_MET)

    async def get_top_eviction_pods(self, active: Sequence[ActivePod], top_n: int,
                                    scope: str) -> TopPods:
        return TopPods(())

    async def get_evict_pods(self, active: Sequence[ActivePod]) -> EvictPods:
        return EvictPods()


async def test_a_plugin_raising_every_round_is_logged_once_per_streak() -> None:
    sink = MemoryAuditSink()
    calls = PluginCalls(AuditLog(sink))
    plugin = Tripping()
    answers: dict[str, ThresholdMet] = {}
    with capture_logs() as logs:
        for _ in range(3600):  # an hour of rounds under pressure
            await calls.ask(plugin, "ThresholdMet", plugin.threshold_met, 0.5, answers)
        plugin.broken = False
        await calls.ask(plugin, "ThresholdMet", plugin.threshold_met, 0.5, answers)
        plugin.broken = True
        await calls.ask(plugin, "ThresholdMet", plugin.threshold_met, 0.5, answers)
    bugs = [e for e in logs if e["event"] == "eviction_plugin_bug"]
    assert len(bugs) == 2
    assert all(e["exc_info"] for e in bugs)  # the traceback, for whoever fixes the plugin
    assert [r["failures"] for r in sink.named("eviction_plugin_failed")] == [1, 1]
    assert [r["failures"] for r in sink.named("eviction_plugin_recovered")] == [3600]
