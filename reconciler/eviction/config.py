"""Configuration of eviction through the Kubernetes API."""

from __future__ import annotations

from dataclasses import dataclass

from hooks.config_fields import setting


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    enabled: bool = setting(False, "Evict reclaimed pods through the Eviction API.")
    dry_run: bool = setting(True, "Decide and audit evictions without calling the API.")
    max_per_minute: int = setting(3, "Rate limit of evictions.", minimum=1, maximum=1000)
