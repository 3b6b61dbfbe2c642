"""A configuration whose memory guard holds its standing cap on cgroup v1 and v2 alike, for the
tests of that cap (by default the guard holds one on cgroup v1 only)."""

from __future__ import annotations

import dataclasses
from typing import Any

from nri_plugin.config.schema import Config


def standing(cfg: Config | None = None, **guard: Any) -> Config:
    """``cfg`` (default: the defaults) with ``memory_guard.standing_cap = "always"`` and the
    other ``memory_guard`` settings given."""
    base = cfg if cfg is not None else Config()
    return dataclasses.replace(base, memory_guard=dataclasses.replace(
        base.memory_guard, standing_cap="always", **guard))
