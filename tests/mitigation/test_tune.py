"""The tune-memcg rung: the memory guard squeezed (v1 limit, v2 memory.high), held, tightened
again on fresh pressure only, raised with anonymous memory, released, woken at once;
memory.wmark_ratio where the kernel has it; dry-run and missing knobs."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.detection.pods import PodIndex
from reconciler.detection.signals import Level, Reading
from reconciler.host.cgroups import layout_for
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from reconciler.loops.memory_guard import MemoryGuardLoop
from reconciler.loops.memory_squeeze import PAUSED_RECHECK_S, GuardSqueeze, Squeeze, squeezed
from reconciler.mitigation.actions import Cause, TuneAction
from reconciler.runner import run_reconciler
from tests.support.fakesys import GIB, MIB, PAGE, READ_ONLY_NUMBER, FakeHost, refuse_writes
from tests.support.guard_config import standing
from tests.support.polling import eventually

SQUEEZE = Squeeze(64 * MIB, 256 * MIB, "psi node 42 percent")


def guard(tmp_path: Path, version: int, usage: int, anon: int = 0,
          cfg: Config | None = None) -> tuple[FakeHost, MemoryGuardLoop, GuardSqueeze,
                                              MemoryAuditSink]:
    host = FakeHost(tmp_path, version=version, driver="systemd" if version == 2 else "cgroupfs")
    host.set_numa([(60 * GIB, 64 * GIB, 0)])  # plenty of headroom: an unsqueezed cap is high
    host.set_tier_usage("besteffort", usage)
    (host.tier_dir("besteffort") / "memory.stat").write_text(
        f"anon {anon}\nfile {usage - anon}\n" if version == 2
        else f"cache 0\nrss 0\ntotal_cache {usage - anon}\ntotal_rss {anon}\n")
    sink = MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit)
    squeeze = GuardSqueeze()
    config = cfg or Config()
    loop = MemoryGuardLoop(lambda: config, sysfs, layout_for(sysfs), audit, squeeze)
    return host, loop, squeeze, sink


def tier_file(host: FakeHost, name: str) -> int:
    return int((host.tier_dir("besteffort") / name).read_text())


def test_squeezed_formula() -> None:
    assert squeezed(4 * GIB, 0, SQUEEZE) == 4 * GIB - 64 * MIB
    assert squeezed(300 * MIB, 0, SQUEEZE) == 256 * MIB  # the floor
    assert squeezed(GIB + 100 * MIB, GIB, SQUEEZE) == GIB + 64 * MIB  # a step above anonymous
    assert squeezed(4 * GIB + 100, 0, SQUEEZE) % PAGE == 0


@pytest.mark.parametrize("stat", [None, "garbage\n"])
def test_an_unreadable_tier_stat_counts_no_anonymous_memory(tmp_path: Path,
                                                            stat: str | None) -> None:
    host, loop, squeeze, _ = guard(tmp_path, 1, 300 * MIB, anon=200 * MIB)
    path = host.tier_dir("besteffort") / "memory.stat"
    if stat is None:
        path.unlink()
    else:
        path.write_text(stat)
    squeeze.set(SQUEEZE)
    loop.cycle(0.0)
    # anonymous memory taken as 0: the floor holds, not a step above the 200 MiB
    assert tier_file(host, "memory.limit_in_bytes") == 256 * MIB


def test_v1_limit_is_held_below_usage_then_restored(tmp_path: Path) -> None:
    host, loop, squeeze, sink = guard(tmp_path, 1, 4 * GIB)
    loop.cycle(0.0)
    normal = tier_file(host, "memory.limit_in_bytes")
    assert normal > 50 * GIB
    squeeze.set(SQUEEZE)
    loop.cycle(1.0)
    # at once, not one max_step_bytes per cycle from the previous cap
    assert tier_file(host, "memory.limit_in_bytes") == 4 * GIB - 64 * MIB
    record = sink.named("memory_guard_cap")[-1]
    assert record["squeezed"] is True
    assert record["previous_bytes"] == normal
    assert "squeezed to" in sink.named("cgroup_write")[-1]["reason"]
    # the tier reclaimed down to its limit: later cycles hold it there, no lower
    host.set_tier_usage("besteffort", 4 * GIB - 64 * MIB)
    loop.cycle(6.0)
    assert tier_file(host, "memory.limit_in_bytes") == 4 * GIB - 64 * MIB
    # a new ask of the ladder (a repeat on fresh pressure): a step below the limit held
    squeeze.set(dataclasses.replace(SQUEEZE, tightening=1))
    loop.cycle(7.0)
    assert tier_file(host, "memory.limit_in_bytes") == 4 * GIB - 128 * MIB
    loop.cycle(12.0)
    assert tier_file(host, "memory.limit_in_bytes") == 4 * GIB - 128 * MIB
    squeeze.set(None)
    loop.cycle(13.0)
    # restored at once to the unsqueezed cap: the tier's (now smaller) usage plus the headroom
    assert tier_file(host, "memory.limit_in_bytes") == normal - 64 * MIB
    assert sink.named("memory_guard_cap")[-1]["squeezed"] is False


def test_a_new_ask_tightens_from_the_limit_held_not_from_a_usage_that_just_fell(
        tmp_path: Path) -> None:
    host, loop, squeeze, _ = guard(tmp_path, 1, 3 * GIB, anon=2 * GIB)
    squeeze.set(SQUEEZE)
    loop.cycle(0.0)
    assert tier_file(host, "memory.limit_in_bytes") == 3 * GIB - 64 * MIB
    # the job has just freed its 2 GiB buffer, and will take it again in a moment
    set_anon(host, GIB, 0)
    squeeze.set(dataclasses.replace(SQUEEZE, tightening=1))
    loop.cycle(1.0)
    assert tier_file(host, "memory.limit_in_bytes") == 3 * GIB - 128 * MIB


def set_anon(host: FakeHost, usage: int, anon: int) -> None:
    host.set_tier_usage("besteffort", usage)
    (host.tier_dir("besteffort") / "memory.stat").write_text(
        f"cache 0\nrss 0\ntotal_cache {usage - anon}\ntotal_rss {anon}\n")


def test_a_held_squeeze_rises_with_anonymous_memory(tmp_path: Path) -> None:
    host, loop, squeeze, _ = guard(tmp_path, 1, 2 * GIB, anon=GIB)
    squeeze.set(SQUEEZE)
    loop.cycle(0.0)
    assert tier_file(host, "memory.limit_in_bytes") == 2 * GIB - 64 * MIB
    # the offline job grew its anonymous memory into its own page cache, up to a step below
    # the limit: still held...
    set_anon(host, 2 * GIB - 64 * MIB, 2 * GIB - 128 * MIB)
    loop.cycle(5.0)
    assert tier_file(host, "memory.limit_in_bytes") == 2 * GIB - 64 * MIB
    # ...one page more and the limit rises with it, to stay a step above it whatever the
    # pressure (anonymous memory cannot be reclaimed without swap: the kernel would kill)
    set_anon(host, 2 * GIB - 64 * MIB, 2 * GIB - 128 * MIB + PAGE)
    loop.cycle(10.0)
    assert tier_file(host, "memory.limit_in_bytes") == 2 * GIB - 64 * MIB + PAGE
    set_anon(host, 2 * GIB - 64 * MIB, 2 * GIB - 64 * MIB)
    loop.cycle(12.0)
    assert tier_file(host, "memory.limit_in_bytes") == 2 * GIB
    # it shrank again: the limit stays where it went
    set_anon(host, GIB, GIB - 64 * MIB)
    loop.cycle(15.0)
    assert tier_file(host, "memory.limit_in_bytes") == 2 * GIB


def test_v1_squeeze_spares_anonymous_memory_and_the_floor(tmp_path: Path) -> None:
    host, loop, squeeze, _ = guard(tmp_path, 1, GIB + 32 * MIB, anon=GIB)
    squeeze.set(SQUEEZE)
    loop.cycle(0.0)
    assert tier_file(host, "memory.limit_in_bytes") == GIB + 64 * MIB
    host2, loop2, squeeze2, _ = guard(tmp_path / "small", 1, 200 * MIB)
    squeeze2.set(SQUEEZE)
    loop2.cycle(0.0)
    assert tier_file(host2, "memory.limit_in_bytes") == 256 * MIB


def test_v1_squeeze_keeps_the_no_oom_cliff_bound(tmp_path: Path) -> None:
    cfg = Config()
    cfg = dataclasses.replace(cfg, memory_guard=dataclasses.replace(
        cfg.memory_guard, max_step_bytes=16 * MIB))
    host, loop, squeeze, _ = guard(tmp_path, 1, 4 * GIB, cfg=cfg)
    squeeze.set(SQUEEZE)
    loop.cycle(0.0)
    assert tier_file(host, "memory.limit_in_bytes") == 4 * GIB - 16 * MIB


def test_v2_memory_high_is_squeezed_and_max_kept(tmp_path: Path) -> None:
    host, loop, squeeze, sink = guard(tmp_path, 2, 4 * GIB, cfg=standing())
    loop.cycle(0.0)
    cap = tier_file(host, "memory.max")
    squeeze.set(SQUEEZE)
    loop.cycle(1.0)
    assert tier_file(host, "memory.max") == cap
    assert tier_file(host, "memory.high") == 4 * GIB - 64 * MIB
    record = sink.named("memory_guard_cap")[-1]
    assert record["squeezed"] is True
    assert record["high_bytes"] == 4 * GIB - 64 * MIB
    squeeze.set(None)
    loop.cycle(2.0)
    assert tier_file(host, "memory.high") == int(cap * 0.95) // PAGE * PAGE


THROTTLE = dataclasses.replace(SQUEEZE, spare_anonymous=False)


def test_v2_throttling_holds_memory_high_below_anonymous_memory(tmp_path: Path) -> None:
    host, loop, squeeze, _ = guard(tmp_path, 2, 3 * GIB, anon=3 * GIB - 16 * MIB,
                                  cfg=standing())
    loop.cycle(0.0)
    cap = tier_file(host, "memory.max")
    squeeze.set(THROTTLE)
    loop.cycle(1.0)
    # a step below the usage, under the anonymous memory (spared, it would be a step above)
    assert tier_file(host, "memory.high") == 3 * GIB - 64 * MIB
    assert tier_file(host, "memory.max") == cap
    # the job grew past it anyway (the kernel throttles, it does not stop): held, not raised
    host.set_tier_usage("besteffort", 3 * GIB + 512 * MIB)
    (host.tier_dir("besteffort") / "memory.stat").write_text(
        f"anon {3 * GIB + 512 * MIB}\nfile 0\n")
    loop.cycle(6.0)
    assert tier_file(host, "memory.high") == 3 * GIB - 64 * MIB
    squeeze.set(dataclasses.replace(THROTTLE, tightening=1))  # fresh pressure: a step lower
    loop.cycle(7.0)
    assert tier_file(host, "memory.high") == 3 * GIB - 128 * MIB
    squeeze.set(None)  # released: the unsqueezed memory.high at once
    loop.cycle(8.0)
    assert tier_file(host, "memory.high") == \
        int(tier_file(host, "memory.max") * 0.95) // PAGE * PAGE


def test_v1_spares_anonymous_memory_whatever_the_squeeze_says(tmp_path: Path) -> None:
    host, loop, squeeze, _ = guard(tmp_path, 1, 3 * GIB, anon=3 * GIB - 16 * MIB)
    squeeze.set(THROTTLE)
    loop.cycle(0.0)
    # a hard limit under anonymous memory the kernel could not reclaim: refused, or a kill
    assert tier_file(host, "memory.limit_in_bytes") == 3 * GIB + 48 * MIB


def test_subscribers_hear_changes_only() -> None:
    squeeze, calls = GuardSqueeze(), []
    stop = squeeze.subscribe(lambda: calls.append(1))
    assert squeeze.set(SQUEEZE) is True
    assert squeeze.set(SQUEEZE) is False
    assert squeeze.set(None) is True
    assert calls == [1, 1]
    stop()
    squeeze.set(SQUEEZE)
    assert calls == [1, 1]


def test_a_new_ask_of_the_ladder_is_not_held_back_by_the_wake_gap(tmp_path: Path) -> None:
    _, loop, squeeze, _ = guard(tmp_path, 1, 4 * GIB)
    usual = loop.wake_gap()
    assert usual == 0.5  # a tenth of the 5 s period
    loop.cycle(0.0)
    assert loop.wake_gap() == usual
    squeeze.set(SQUEEZE)  # a squeeze right after a cycle: that cycle did not see it
    assert loop.wake_gap() == 0.0
    loop.cycle(0.1)
    # squeezed on v1: a tenth of the shorter period (a task may wait at the limit)
    assert loop.wake_gap() == PAUSED_RECHECK_S / 10
    squeeze.set(dataclasses.replace(SQUEEZE, tightening=1))
    assert loop.wake_gap() == 0.0
    loop.cycle(0.2)
    squeeze.set(None)  # a release too
    assert loop.wake_gap() == 0.0
    loop.cycle(0.3)
    assert loop.wake_gap() == usual


async def test_a_squeeze_wakes_the_guard_at_once(tmp_path: Path) -> None:
    host, loop, squeeze, _ = guard(tmp_path, 1, 4 * GIB)
    stop = asyncio.Event()
    task = asyncio.create_task(run_reconciler(
        [loop], NodeState(), stop, None, read_keys=lambda: Config().read_keys(),
        backoff_max=lambda: 60.0))
    await eventually(lambda: tier_file(host, "memory.limit_in_bytes") > 50 * GIB)
    squeeze.set(SQUEEZE)  # the guard's period is 5 s: only the wake-up makes this quick
    await eventually(lambda: tier_file(host, "memory.limit_in_bytes") == 4 * GIB - 64 * MIB)
    stop.set()
    await asyncio.wait_for(task, 5)


# -- the action -----------------------------------------------------------------------------------

def tune(tmp_path: Path, *, wmark: bool, guard_on: bool = True, throttle: bool = False,
         version: int = 2) -> tuple[TuneAction, GuardSqueeze, FakeHost, MemoryAuditSink]:
    host = FakeHost(tmp_path, version=version, driver="systemd" if version == 2 else "cgroupfs")
    if wmark:
        (host.tier_dir("guaranteed") / "memory.wmark_ratio").write_text("0\n")
    level = "qos.nri-qos.io/level"
    for name, lvl, tier in (("batch", "reclaimed_cores", "besteffort"),
                            ("web", "shared_cores", "burstable")):
        pod = host.add_pod(f"{name}-0000-4000-8000-000000000000", tier=tier, name=name,
                           annotations={level: lvl})
        if wmark:
            (host.cg("memory", host.pod_rel(tier, pod.info.uid)) / "memory.wmark_ratio"
             ).write_text("95\n")
    sink = MemoryAuditSink()
    sysfs = SysFs(tmp_path, AuditLog(sink))
    state = NodeState()
    state.replace_all(*host.nri())
    info = probe_host(sysfs)
    cfg = Config()
    cfg = dataclasses.replace(cfg, memory_guard=dataclasses.replace(cfg.memory_guard,
                                                                    enabled=guard_on))
    mitigation = cfg.mitigation
    cfg = dataclasses.replace(cfg, mitigation=dataclasses.replace(
        mitigation, tune=dataclasses.replace(mitigation.tune, throttle_anonymous=throttle)))
    squeeze = GuardSqueeze()
    action = TuneAction(lambda: cfg, squeeze, sysfs, info, PodIndex(state, info.cgroup),
                        lambda: True)
    return action, squeeze, host, sink


def wmark_of(host: FakeHost, name: str, tier: str) -> str:
    uid = f"{name}-0000-4000-8000-000000000000"
    return (host.cg("memory", host.pod_rel(tier, uid)) / "memory.wmark_ratio").read_text()


async def test_tune_engages_and_releases_the_squeeze(tmp_path: Path) -> None:
    action, squeeze, _, _ = tune(tmp_path, wmark=False)
    cause = Cause(Level.LOW)
    result = await action.engage(cause, dry_run=False)
    assert result.result == "done"
    assert "memory.high held 67108864 B below" in result.detail
    current = squeeze.current()
    assert current is not None
    assert (current.step_bytes, current.floor_bytes, current.reason) == (
        64 * MIB, 256 * MIB, cause.text())
    assert (await action.release(cause, dry_run=False)).result == "done"
    assert squeeze.current() is None
    assert (await action.release(cause, dry_run=False)).result == "unchanged"


@pytest.mark.parametrize(("version", "throttle", "spared"), [
    (2, False, True), (2, True, False), (1, True, True)])
async def test_throttling_anonymous_memory_is_asked_for_on_v2_only(
        tmp_path: Path, version: int, throttle: bool, spared: bool) -> None:
    action, squeeze, _, _ = tune(tmp_path, wmark=False, throttle=throttle, version=version)
    result = await action.engage(Cause(Level.LOW), dry_run=False)
    current = squeeze.current()
    assert current is not None
    assert current.spare_anonymous is spared
    assert ("above its anonymous memory" in result.detail) is spared


def reading(level: Level, raw: Level | None) -> Reading:
    return Reading("pressure_level", "tier:kubepods", level, 1.0, 1.0, "events",
                   "memory.pressure_level low", raw=raw)


async def test_a_repeat_tightens_on_fresh_pressure_only(tmp_path: Path) -> None:
    action, squeeze, _, _ = tune(tmp_path, wmark=False)
    await action.engage(Cause(Level.LOW, reading(Level.LOW, Level.LOW)), dry_run=False)
    first = squeeze.current()
    assert first is not None
    # the latest sample still shows the pressure: another step
    fresh = Cause(Level.LOW, reading(Level.LOW, Level.LOW))
    result = await action.repeat(fresh, dry_run=False)
    assert result.result == "done"
    assert "held 67108864 B below the limit held" in result.detail
    second = squeeze.current()
    assert second is not None
    assert second.tightening > first.tightening
    assert second.reason == fresh.text()
    # the level is only held by hysteresis: the tier stays where it is
    held = Cause(Level.LOW, reading(Level.LOW, Level.NONE))
    result = await action.repeat(held, dry_run=False)
    assert result.result == "unchanged"
    assert "no longer fresh" in result.detail
    assert squeeze.current() == second
    # a cause without a reading (or one that does not say) counts as fresh
    assert (await action.repeat(Cause(Level.LOW), dry_run=False)).result == "done"
    assert (await action.repeat(Cause(Level.LOW, reading(Level.LOW, None)),
                                dry_run=False)).result == "done"


async def test_a_repeat_on_an_unknown_reading_holding_its_last_level_does_not_tighten(
        tmp_path: Path) -> None:
    """The ladder counts an unknown reading at the level it last had, but its sample is at no
    level: that is not fresh pressure, and the tier is held where it is, not squeezed a step
    lower every repeat_s for as long as the file stays unreadable."""
    action, squeeze, _, _ = tune(tmp_path, wmark=False)
    await action.engage(Cause(Level.LOW, reading(Level.LOW, Level.LOW)), dry_run=False)
    first = squeeze.current()
    unknown = Reading("pressure_level", "tier:kubepods", Level.UNKNOWN, 0.0, 0.0, "",
                      "memory.pressure_level is gone", raw=Level.UNKNOWN)
    result = await action.repeat(Cause(Level.LOW, unknown), dry_run=False)
    assert result.result == "unchanged"
    assert squeeze.current() == first


async def test_tune_dry_run_changes_nothing(tmp_path: Path) -> None:
    action, squeeze, host, sink = tune(tmp_path, wmark=True)
    result = await action.engage(Cause(Level.LOW), dry_run=True)
    assert result.result == "dry_run"
    assert "wmark_ratio 80" in result.detail
    assert squeeze.current() is None
    assert wmark_of(host, "batch", "besteffort") == "95\n"
    assert sink.records == []


@pytest.mark.skipif(not READ_ONLY_NUMBER.exists(), reason=f"no {READ_ONLY_NUMBER} here")
async def test_a_refused_wmark_ratio_write_fails_the_rung_and_is_audited(tmp_path: Path) -> None:
    action, squeeze, host, sink = tune(tmp_path, wmark=True)
    uid = "batch-0000-4000-8000-000000000000"
    refuse_writes(host.cg("memory", host.pod_rel("besteffort", uid)) / "memory.wmark_ratio")
    result = await action.engage(Cause(Level.LOW), dry_run=False)
    assert result.result == "failed"
    assert result.detail.endswith("; wmark_ratio not written on 1 pod(s)")
    [failed] = sink.named("cgroup_write_failed")
    assert failed["path"] == (f"/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice/"
                              f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice/"
                              "memory.wmark_ratio")
    assert failed["value"] == "80"
    assert sink.named("cgroup_write") == []
    assert squeeze.current() is not None  # the guard's squeeze is asked all the same


async def test_wmark_ratio_on_reclaimed_pods_only_and_restored(tmp_path: Path) -> None:
    action, _, host, sink = tune(tmp_path, wmark=True)
    await action.engage(Cause(Level.LOW), dry_run=False)
    assert wmark_of(host, "batch", "besteffort") == "80"
    assert wmark_of(host, "web", "burstable") == "95\n"
    assert [r["value"] for r in sink.named("cgroup_write")] == ["80"]
    await action.release(Cause(Level.NONE), dry_run=False)
    assert wmark_of(host, "batch", "besteffort") == "95"


async def test_tune_without_any_knob_is_skipped(tmp_path: Path) -> None:
    action, squeeze, _, _ = tune(tmp_path, wmark=False, guard_on=False)
    result = await action.engage(Cause(Level.LOW), dry_run=False)
    assert result.result == "skipped"
    assert "memory guard is off" in result.detail
    assert squeeze.current() is None
    action2, squeeze2, _, _ = tune(tmp_path / "w", wmark=True, guard_on=False)
    result2 = await action2.engage(Cause(Level.LOW), dry_run=False)
    assert result2.result == "done"
    assert "memory guard off: no squeeze" in result2.detail
    assert squeeze2.current() is None


async def test_a_release_in_dry_run_undoes_the_squeeze_and_the_wmark_ratio_tuned(
        tmp_path: Path) -> None:
    action, squeeze, host, sink = tune(tmp_path, wmark=True)
    assert (await action.engage(Cause(Level.LOW), dry_run=False)).result == "done"
    assert squeeze.current() is not None
    assert wmark_of(host, "batch", "besteffort") == "80"
    # A reload put the rung in dry run (or the node in observe mode): undoing is not held back.
    released = await action.release(Cause(Level.NONE), dry_run=True)
    assert (released.result, released.detail) == (
        "done", "squeeze released; wmark_ratio restored on 1 pod(s)")
    assert squeeze.current() is None
    assert wmark_of(host, "batch", "besteffort") == "95"
    assert [r["value"] for r in sink.named("cgroup_write")] == ["80", "95"]
    # Nothing of the rung's is left: the next one writes nothing.
    again = await action.release(Cause(Level.NONE), dry_run=True)
    assert (again.result, again.detail) == (
        "dry_run", "would release the squeeze and restore memory.wmark_ratio")
    assert len(sink.named("cgroup_write")) == 2


async def test_a_release_in_dry_run_with_nothing_tuned_writes_nothing(tmp_path: Path) -> None:
    action, squeeze, host, sink = tune(tmp_path, wmark=True)
    released = await action.release(Cause(Level.NONE), dry_run=True)
    assert (released.result, released.detail) == (
        "dry_run", "would release the squeeze and restore memory.wmark_ratio")
    assert squeeze.current() is None
    assert wmark_of(host, "batch", "besteffort") == "95\n"
    assert sink.records == []
