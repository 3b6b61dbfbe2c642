"""A node condition the eviction manager wrote True outlives neither the agent's run nor the
plugin that reported it: it is noted in the state file, so the next run (with the manager on or
off, or the reconciler off) and ``nri-qos reset`` know it is this agent's to take back, whatever
plugin reported it (an out-of-tree plugin's name is in no list of the agent's)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.agent import _leftovers
from nri_plugin.cli.reset import reset
from nri_plugin.config.schema import Config
from nri_plugin.config.store import ConfigStore
from reconciler.eviction.api import Condition, MetType, ThresholdMet
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.statefile import StateFile, state_file
from reconciler.host.sysfs import SysFs
from reconciler.kube import KubernetesConfig
from tests.support.eviction_env import NODE, Env, make_env
from tests.support.fake_apiserver import FakeApiServer, write_kubeconfig
from tests.support.polling import eventually

PLUGINS_OWN = "ExampleVendorPressure"
"""A condition name no list of the agent's holds, as an out-of-tree plugin's would be."""


async def tainted_by_an_earlier_run(tmp_path: Path, fake: FakeApiServer) -> StateFile:
    """Runs a manager whose plugin reports :data:`PLUGINS_OWN` met, until the node shows it;
    the run then ends without taking it back (a crash, SIGKILL, an upgrade)."""
    fake.set_conditions(NODE, [{"type": "Ready", "status": "True"}])
    notes = state_file(str(tmp_path / "state"))
    first = make_env(tmp_path / "first", fake, notes=notes)
    first.system.threshold = ThresholdMet(MetType.SOFT_MET, condition=Condition(PLUGINS_OWN,
                                                                                True))
    await first.round()
    assert fake.conditions(NODE)[PLUGINS_OWN]["status"] == "True"
    return state_file(str(tmp_path / "state"))  # read again, as the next run reads it


async def run_until(env: Env, done: object) -> None:
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(env.manager.run(stop))
        try:
            await eventually(done)  # type: ignore[arg-type]
        finally:
            stop.set()


async def test_a_run_with_the_manager_off_takes_off_a_condition_an_earlier_run_left(
        tmp_path: Path, fake: FakeApiServer) -> None:
    notes = await tainted_by_an_earlier_run(tmp_path, fake)
    second = make_env(tmp_path / "second", fake, notes=notes, enabled=False)
    await run_until(second, lambda: fake.condition_types(NODE) == ["Ready"])
    assert PLUGINS_OWN in second.audited("eviction_condition_removed", "condition")
    assert state_file(str(tmp_path / "state")).entries("eviction_condition") == {}


async def test_a_run_whose_plugins_no_longer_report_it_sets_it_false(
        tmp_path: Path, fake: FakeApiServer) -> None:
    notes = await tainted_by_an_earlier_run(tmp_path, fake)
    second = make_env(tmp_path / "second", fake, notes=notes)
    await second.round()  # its plugins report nothing of the kind
    assert fake.conditions(NODE)[PLUGINS_OWN]["status"] == "False"
    assert state_file(str(tmp_path / "state")).entries("eviction_condition") == {}


def next_runs_config(tmp_path: Path, fake: FakeApiServer, *, reconciler: bool = True) -> Config:
    """The configuration of a run after :func:`tainted_by_an_earlier_run`: the same host, state
    file and API server, the reconciler on or off."""
    cfg = Config()
    kube = KubernetesConfig(kubeconfig=str(write_kubeconfig(tmp_path / "kc", fake.url)),
                            node_name=NODE, request_timeout_s=5.0)
    return dataclasses.replace(cfg, kubernetes=kube, reconciler=dataclasses.replace(
        cfg.reconciler, root=str(tmp_path / "first" / "host"),
        enabled=reconciler, state_dir=str(tmp_path / "state")))


async def test_a_start_with_the_reconciler_off_takes_it_off(
        tmp_path: Path, fake: FakeApiServer) -> None:
    await tainted_by_an_earlier_run(tmp_path, fake)
    cfg = next_runs_config(tmp_path, fake, reconciler=False)
    audit = AuditLog(MemoryAuditSink())
    store = ConfigStore(audit, config=cfg)
    leftovers = _leftovers(store, SysFs(cfg.reconciler.root, audit), audit,
                           state_file(cfg.reconciler.state_dir), CgroupLayout(1, "cgroupfs"))
    await asyncio.wait_for(leftovers(asyncio.Event()), 10.0)
    assert fake.condition_types(NODE) == ["Ready"]
    assert state_file(str(tmp_path / "state")).entries("eviction_condition") == {}


async def test_reset_takes_off_a_condition_the_manager_noted(
        tmp_path: Path, fake: FakeApiServer) -> None:
    await tainted_by_an_earlier_run(tmp_path, fake)
    cfg = next_runs_config(tmp_path, fake)
    cfg = dataclasses.replace(cfg, status=dataclasses.replace(
        cfg.status, socket=str(tmp_path / "status.sock")))
    out = io.StringIO()
    code = await asyncio.to_thread(reset, cfg, AuditLog(MemoryAuditSink()), dry_run=False,
                                   out=out)
    assert code == 0, out.getvalue()
    assert f"remove condition {PLUGINS_OWN}: removed" in out.getvalue()
    assert fake.condition_types(NODE) == ["Ready"]
    assert state_file(str(tmp_path / "state")).entries("eviction_condition") == {}


async def test_a_reload_switching_the_reconciler_off_takes_the_managers_conditions_off(
        tmp_path: Path, fake: FakeApiServer) -> None:
    """``[reconciler] enabled = false`` switches the eviction manager off with the rest of the
    background half: its conditions go, as with ``[eviction] enabled = false``, and no round
    runs, though its plugin still reports the condition met."""
    fake.set_conditions(NODE, [{"type": "Ready", "status": "True"}])
    env = make_env(tmp_path, fake, interval_s=0.05, quiet_interval_s=0.05)
    env.system.threshold = ThresholdMet(MetType.SOFT_MET, condition=Condition(PLUGINS_OWN,
                                                                              True))
    await env.round()
    assert fake.conditions(NODE)[PLUGINS_OWN]["status"] == "True"
    asked = len(env.system.called("threshold_met"))
    cfg = env.cfg[0]
    env.cfg[0] = dataclasses.replace(cfg, reconciler=dataclasses.replace(cfg.reconciler,
                                                                         enabled=False))
    await run_until(env, lambda: fake.condition_types(NODE) == ["Ready"])
    assert len(env.system.called("threshold_met")) == asked
