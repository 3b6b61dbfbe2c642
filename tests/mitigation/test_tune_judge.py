"""The tune rung judging its squeeze: kept when the pod that engaged it was relieved, released
and held off when not, tried anew after the hold on fresh pressure; not judged without a pod's
own reading, without its file, or with judge_s = 0; cgroup v2 PSI and cgroup v1 refaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.detection.config import PSI, REFAULT
from reconciler.detection.pods import PodIndex
from reconciler.detection.signals import NODE, Level, Reading, pod_scope
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_squeeze import GuardSqueeze
from reconciler.metrics import ReconcilerMetrics
from reconciler.mitigation.actions import Cause, TuneAction
from tests.support.fakesys import FakeHost

LEVEL = "qos.nri-qos.io/level"
WEB = "web-0000-4000-8000-000000000000"


class Judged:
    """A tune action on a fake host with one online and one reclaimed pod, on a set clock."""

    def __init__(self, tmp_path: Path, version: int = 2, **tune: Any) -> None:
        self.host = FakeHost(tmp_path, version=version,
                             driver="systemd" if version == 2 else "cgroupfs")
        self.version = version
        self.host.add_pod("batch-0000-4000-8000-000000000000", tier="besteffort",
                          name="batch", annotations={LEVEL: "reclaimed_cores"})
        self.host.add_pod(WEB, tier="burstable", name="web",
                          annotations={LEVEL: "shared_cores"})
        self.web = self.host.cg("memory", self.host.pod_rel("burstable", WEB))
        self.sink = MemoryAuditSink()
        sysfs = SysFs(tmp_path, AuditLog(self.sink))
        state = NodeState()
        state.replace_all(*self.host.nri())
        info = probe_host(sysfs)
        cfg = Config()
        tune = {"judge_s": 15.0, **tune}  # off by default
        cfg = dataclasses.replace(cfg, mitigation=dataclasses.replace(
            cfg.mitigation, tune=dataclasses.replace(cfg.mitigation.tune, **tune)))
        self.squeeze = GuardSqueeze()
        self.now = 100.0
        self.metrics = ReconcilerMetrics()
        self.action = TuneAction(lambda: cfg, self.squeeze, sysfs, info,
                                 PodIndex(state, info.cgroup), lambda: True,
                                 clock=lambda: self.now, metrics=self.metrics,
                                 audit=AuditLog(self.sink))

    def judgments(self, verdict: str) -> float | None:
        return self.metrics.registry.get_sample_value("nri_qos_squeeze_judgments_total",
                                                      {"verdict": verdict})

    def counter(self, value: int) -> None:
        """The online pod's stall (µs, v2) or refaults (pages, v1) so far."""
        if self.version == 2:
            (self.web / "memory.pressure").write_text(
                f"some avg10=0.00 avg60=0.00 avg300=0.00 total={value}\n"
                "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
        else:
            (self.web / "memory.stat").write_text(
                f"total_workingset_refault_anon 0\ntotal_workingset_refault_file {value}\n")

    def at(self, now: float, value: int) -> None:
        """The clock at ``now`` with the pod's counter at ``value``."""
        self.now = now
        self.counter(value)

    def cause(self, value: float, fresh: bool = True, uid: str | None = WEB) -> Cause:
        detector = PSI if self.version == 2 else REFAULT
        return Cause(Level.LOW, Reading(
            detector, pod_scope(uid) if uid else NODE, Level.LOW, value, 10.0,
            "percent" if self.version == 2 else "pages/s", "test", uid,
            raw=Level.LOW if fresh else Level.NONE))


async def test_a_squeeze_that_did_not_relieve_the_pod_is_released_and_held_off(
        tmp_path: Path) -> None:
    j = Judged(tmp_path)
    j.counter(0)
    assert (await j.action.engage(j.cause(20.0), dry_run=False)).result == "done"
    first = j.squeeze.current()
    assert first is not None
    # 14.9 s: not judged yet, the squeeze tightens on fresh pressure
    j.at(114.9, 2_980_000)
    result = await j.action.repeat(j.cause(20.0), dry_run=False)
    assert "below the limit held" in result.detail
    # 15 s at a 20 % stall (3 s stalled): above 15 %, futile
    j.at(115.0, 3_000_000)
    result = await j.action.repeat(j.cause(20.0), dry_run=False)
    assert result.result == "done"
    assert result.detail.startswith("squeeze released for 300 s: it did not relieve the pod: "
                                    f"psi of pod {WEB} 20 percent when the squeeze began, "
                                    "20 percent over its 15 s (above 15 percent")
    assert j.squeeze.current() is None
    assert (j.judgments("futile"), j.judgments("relieved")) == (1.0, None)
    [judged] = j.sink.named("squeeze_judged")
    assert {k: judged[k] for k in ("pod_uid", "detector", "before", "during", "unit",
                                   "elapsed_s", "verdict", "hold_s")} == {
        "pod_uid": WEB, "detector": "psi", "before": 20.0, "during": 20.0, "unit": "percent",
        "elapsed_s": 15.0, "verdict": "futile", "hold_s": 300.0}
    j.now = 414.9
    result = await j.action.repeat(j.cause(20.0), dry_run=False)
    assert (result.result, j.squeeze.current()) == ("unchanged", None)
    # the hold over: tried anew only on fresh pressure, from the tier's usage
    j.now = 415.0
    assert (await j.action.repeat(j.cause(20.0, fresh=False), dry_run=False)).detail == \
        "squeeze held off until the pressure is fresh"
    result = await j.action.repeat(j.cause(20.0), dry_run=False)
    assert "below its usage" in result.detail
    assert j.squeeze.current() is not None


async def test_a_squeeze_at_exactly_the_relief_wanted_is_kept(tmp_path: Path) -> None:
    j = Judged(tmp_path)
    j.counter(1_000_000)
    await j.action.engage(j.cause(20.0), dry_run=False)
    j.at(115.0, 1_000_000 + 2_250_000)  # 15 %: 25 % below 20 %
    result = await j.action.repeat(j.cause(20.0, fresh=False), dry_run=False)
    assert result.detail.startswith("held where it is")
    assert j.squeeze.current() is not None
    assert (j.judgments("futile"), j.judgments("relieved")) == (None, 1.0)
    assert [r["verdict"] for r in j.sink.named("squeeze_judged")] == ["relieved"]
    # judged once: a later stall does not undo a kept squeeze
    j.at(200.0, 90_000_000)
    await j.action.repeat(j.cause(20.0), dry_run=False)
    assert j.squeeze.current() is not None


async def test_v1_judges_the_pods_refaults(tmp_path: Path) -> None:
    j = Judged(tmp_path, version=1)
    j.counter(10_000)
    await j.action.engage(j.cause(1000.0), dry_run=False)  # 1,000 pages/s over 10 s before
    j.at(115.0, 10_000 + 15 * 800)  # 800 pages/s squeezed: not 25 % less
    result = await j.action.repeat(j.cause(1000.0), dry_run=False)
    assert "refault of pod" in result.detail
    assert "800 pages/s over its 15 s" in result.detail
    assert j.squeeze.current() is None


async def test_a_release_forgets_the_judgment_and_the_hold(tmp_path: Path) -> None:
    j = Judged(tmp_path)
    j.counter(0)
    await j.action.engage(j.cause(20.0), dry_run=False)
    j.at(115.0, 3_000_000)
    await j.action.repeat(j.cause(20.0), dry_run=False)
    assert j.squeeze.current() is None
    await j.action.release(Cause(Level.NONE), dry_run=False)
    await j.action.engage(j.cause(20.0), dry_run=False)  # engaged anew: squeezes at once
    assert j.squeeze.current() is not None


async def test_what_is_not_judged(tmp_path: Path) -> None:
    j = Judged(tmp_path)
    j.counter(0)
    # the node's PSI names no pod
    await j.action.engage(j.cause(20.0, uid=None), dry_run=False)
    j.at(200.0, 90_000_000)
    await j.action.repeat(j.cause(20.0, uid=None), dry_run=False)
    assert j.squeeze.current() is not None
    # the pod's file unreadable at the start
    await j.action.release(Cause(Level.NONE), dry_run=False)
    (j.web / "memory.pressure").unlink()
    result = await j.action.engage(j.cause(20.0), dry_run=False)
    assert result.detail.endswith("not judged: the pod's memory.pressure is not readable")
    j.now = 300.0
    await j.action.repeat(j.cause(20.0), dry_run=False)
    assert j.squeeze.current() is not None


async def test_the_pods_file_gone_at_the_judgment_keeps_the_squeeze(tmp_path: Path) -> None:
    j = Judged(tmp_path)
    j.counter(0)
    await j.action.engage(j.cause(20.0), dry_run=False)
    (j.web / "memory.pressure").write_text("garbage\n")
    j.now = 115.0
    await j.action.repeat(j.cause(20.0), dry_run=False)
    assert j.squeeze.current() is not None


async def test_judge_s_zero_the_default_never_judges(tmp_path: Path) -> None:
    assert Config().mitigation.tune.judge_s == 0.0
    j = Judged(tmp_path, judge_s=0.0)
    j.counter(0)
    await j.action.engage(j.cause(20.0), dry_run=False)
    j.at(1000.0, 900_000_000)
    await j.action.repeat(j.cause(20.0), dry_run=False)
    assert j.squeeze.current() is not None
