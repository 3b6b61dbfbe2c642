"""A reload reaches every capability: one whose reconfiguration fails is logged and the ones
after it still take the new configuration (the loops run it at once)."""

from __future__ import annotations

import dataclasses

from structlog.testing import capture_logs

from nri_plugin.agent import _reconfigurer
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability


class Taking(Capability):
    """Keeps the configuration it is given; ``fails`` raises instead."""

    events = frozenset()

    def __init__(self, name: str, *, fails: bool = False) -> None:
        self.name = name
        self.fails = fails
        self.config: Config | None = None

    def reconfigure(self, config: Config) -> None:
        if self.fails:
            raise RuntimeError("cannot take it")
        self.config = config


def test_a_capability_that_fails_to_take_a_reload_does_not_hold_back_the_others() -> None:
    first, failing, last = Taking("first"), Taking("failing", fails=True), Taking("last")
    old = Config()
    new = dataclasses.replace(old, oom=dataclasses.replace(old.oom, enabled=False))
    with capture_logs() as logs:
        _reconfigurer([first, failing, last])(old, new)
    assert (first.config, last.config) == (new, new)
    [failed] = [e for e in logs if e["event"] == "capability_reconfigure_failed"]
    assert failed["capability"] == "failing"
