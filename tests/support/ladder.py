"""Rungs, fake actions and a running service shared by the mitigation ladder's tests."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.detection.signals import NODE, Board, Level, Reading
from reconciler.mitigation.actions import DONE, DRY_RUN, FAILED, Cause, Result
from reconciler.mitigation.ladder import Rung
from reconciler.mitigation.service import Mitigation, dry_run_of
from tests.support.polling import BOUND_S, eventually

TAINT, TUNE, DROP, EVICT = (Rung("taint", Level.LOW), Rung("tune", Level.LOW),
                            Rung("drop_cache", Level.MEDIUM, 30.0), Rung("evict", Level.HIGH, 5.0))
RUNGS = [TAINT, TUNE, DROP, EVICT]
COOLDOWN = 60.0


class FakeAction:
    """Records calls; can fail or hang on a step."""

    def __init__(self, name: str, calls: list[tuple[str, str, bool]]) -> None:
        self.name = name
        self.calls = calls
        self.fail: BaseException | None = None
        # Steps answered "failed" (an API that refuses), not raised.
        self.refuse: set[str] = set()
        self.hang = asyncio.Event()
        self.hanging = False

    async def _run(self, step: str, cause: Cause, dry_run: bool) -> Result:
        self.calls.append((self.name, step, dry_run))
        if self.hanging:
            await self.hang.wait()
        if self.fail is not None:
            raise self.fail
        if step in self.refuse:
            return Result(FAILED, f"{self.name} {step} refused")
        return Result(DRY_RUN if dry_run else DONE, f"{self.name} {step}")

    async def engage(self, cause: Cause, dry_run: bool) -> Result:
        return await self._run("engage", cause, dry_run)

    async def repeat(self, cause: Cause, dry_run: bool) -> Result:
        return await self._run("repeat", cause, dry_run)

    async def release(self, cause: Cause, dry_run: bool) -> Result:
        return await self._run("release", cause, dry_run)


def config(cooldown: float = 0.2, **rungs: dict[str, Any]) -> Config:
    cfg = Config()
    m = cfg.mitigation
    changes = {name: dataclasses.replace(getattr(m, name), **values)
               for name, values in rungs.items()}
    return dataclasses.replace(cfg, mitigation=dataclasses.replace(m, cooldown_s=cooldown,
                                                                   **changes))


def reading(detector: str, level: Level, scope: str = NODE, value: float = 42.0) -> Reading:
    return Reading(detector, scope, level, value, 10.0, "percent", "test reading")


class Running:
    def __init__(self, cfg: Config, names: tuple[str, ...] = ("taint", "tune", "drop_cache",
                                                               "evict")) -> None:
        self.cfg = cfg
        self.board = Board()
        self.sink = MemoryAuditSink()
        self.calls: list[tuple[str, str, bool]] = []
        self.actions = {name: FakeAction(name, self.calls) for name in names}
        self.mitigation = Mitigation(lambda: self.cfg, self.board, self.actions,
                                     AuditLog(self.sink))
        self.stop = asyncio.Event()

    async def __aenter__(self) -> Running:
        self.task = asyncio.create_task(self.mitigation.run(self.stop))
        # the start clears what an earlier run may have left: one release per rung
        await self.until(lambda: len(self.calls) >= len(self.actions))
        assert sorted(self.calls) == sorted((n, "release", dry_run_of(self.cfg.mitigation, n))
                                            for n in self.actions)
        self.calls.clear()
        self.sink.records.clear()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, BOUND_S)

    async def until(self, check: Callable[[], bool]) -> None:
        await eventually(check)

    def actions_audited(self) -> list[tuple[str, str, str, bool]]:
        return [(r["action"], r["step"], r["result"], r["dry_run"])
                for r in self.sink.named("mitigation_action")]
