"""A rung switched to dry run while the pressure holds undoes what it placed, and a refused undo
is tried again, as any release is, while the rung stays engaged in dry run: a taint left on the
node would otherwise stay until the pressure ends and the cooldown has passed."""

from __future__ import annotations

import asyncio
import dataclasses

from nri_plugin.config.schema import Config
from reconciler.detection.signals import Level
from reconciler.mitigation.service import IDLE_RECHECK_S
from tests.support.ladder import Running, config, reading
from tests.support.polling import eventually

NOTICED_S = IDLE_RECHECK_S + 5.0
"""A reload reaches the ladder at its next look, at most ``IDLE_RECHECK_S`` later."""


def taint_dry_run(cfg: Config, dry_run: bool) -> Config:
    m = cfg.mitigation
    return dataclasses.replace(cfg, mitigation=dataclasses.replace(
        m, taint=dataclasses.replace(m.taint, dry_run=dry_run)))


async def tainted_then_switched_to_dry_run_with_the_undo_refused() -> Running:
    cfg = config(cooldown=3600.0)
    run = Running(dataclasses.replace(cfg, mitigation=dataclasses.replace(
        cfg.mitigation, retry_initial_s=0.1, retry_max_s=0.2)), names=("taint",))
    await run.__aenter__()
    run.board.publish("psi", [reading("psi", Level.LOW)])
    await run.until(lambda: ("taint", "engage", False) in run.calls)
    run.actions["taint"].refuse.add("release")
    run.cfg = taint_dry_run(run.cfg, True)
    await eventually(lambda: ("taint", "release", "failed", True) in run.actions_audited(),
                     NOTICED_S)
    return run


async def test_a_refused_undo_after_a_switch_to_dry_run_is_tried_again() -> None:
    run = await tainted_then_switched_to_dry_run_with_the_undo_refused()
    try:
        run.actions["taint"].refuse.discard("release")
        await eventually(lambda: ("taint", "release", "dry_run", True)
                         in run.actions_audited(), NOTICED_S)
        assert "taint" in run.mitigation.state().engaged  # the pressure still holds
        # Undone once: nothing more while the rung stays engaged in dry run.
        settled = len(run.calls)
        await asyncio.sleep(0.5)
        assert run.calls[settled:] == []
    finally:
        await run.__aexit__(None, None, None)


async def test_switched_back_to_enforce_before_the_undo_succeeds_it_engages_again() -> None:
    run = await tainted_then_switched_to_dry_run_with_the_undo_refused()
    try:
        run.cfg = taint_dry_run(run.cfg, False)
        await eventually(lambda: run.calls[-1] == ("taint", "engage", False), NOTICED_S)
        settled = len(run.calls)
        await asyncio.sleep(0.5)
        assert run.calls[settled:] == []
    finally:
        await run.__aexit__(None, None, None)
