"""Calls to eviction plugins under a deadline, and the audit of their failures.

A plugin that misses its deadline, fails or answers garbage costs its own answer for the round
and nothing more. Failures are audited once per streak of one call (and again when the kind of
failure changes), and the end of a streak once: a plugin down for an hour writes two records,
not one per second; an in-tree plugin's exception logs its traceback once per streak too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from common.audit import AuditLog
from reconciler.eviction.api import EvictionPlugin
from reconciler.eviction.remote import PluginCallError

log = structlog.get_logger("nri_qos.eviction")

# The asyncio guard around a plugin call is a little longer than the deadline the call itself
# carries, so that a remote plugin's lateness is reported by gRPC as a missed deadline.
DEADLINE_MARGIN_S = 0.05

T = TypeVar("T")


@dataclass(slots=True)
class _Failing:
    count: int = 0
    kinds: set[str] = field(default_factory=set)


class PluginCalls:
    """Asks plugins; keeps each (plugin, call)'s current streak of failures."""

    def __init__(self, audit: AuditLog) -> None:
        self._audit = audit
        self._failing: dict[tuple[str, str], _Failing] = {}

    def keep_only(self, names: Collection[str]) -> None:
        """Forget the streaks of plugins that are gone."""
        for key in [k for k in self._failing if k[0] not in names]:
            del self._failing[key]

    async def ask(self, plugin: EvictionPlugin, call: str, fn: Callable[[], Awaitable[T]],
                  deadline: float, into: dict[str, T]) -> None:
        """One plugin call under its deadline; the answer lands in ``into``, a failure in the
        audit trail. Never raises (but for cancellation): one plugin cannot end a round."""
        try:
            async with asyncio.timeout(deadline + DEADLINE_MARGIN_S):
                into[plugin.name] = await fn()
        except TimeoutError:
            self._failed(plugin.name, call, PluginCallError(
                "deadline", f"no answer within {deadline} s"))
        except PluginCallError as exc:
            self._failed(plugin.name, call, exc)
        except Exception as exc:  # an in-tree plugin's bug costs its round, nothing more
            failing = self._failing.get((plugin.name, call))
            if failing is None or "error" not in failing.kinds:  # its traceback once a streak
                log.warning("eviction_plugin_bug", plugin=plugin.name, call=call, exc_info=True)
            self._failed(plugin.name, call, PluginCallError("error", repr(exc)))
        else:
            failing = self._failing.pop((plugin.name, call), None)
            if failing is not None:
                self._audit.record("eviction_plugin_recovered", plugin=plugin.name, call=call,
                                   failures=failing.count)

    def _failed(self, plugin: str, call: str, exc: PluginCallError) -> None:
        """Audited at the first failure of a streak of this call, and when its kind changes."""
        failing = self._failing.setdefault((plugin, call), _Failing())
        failing.count += 1
        if exc.kind not in failing.kinds:
            failing.kinds.add(exc.kind)
            self._audit.record("eviction_plugin_failed", plugin=plugin, call=call,
                               error=str(exc), kind=exc.kind, failures=failing.count)
