"""The configuration keys the running agent takes at start only, and what a reload does with them.

Most of the configuration is read where it is used, so a reload applies from the next event or
loop cycle. The keys of :data:`START_ONLY` are read while the agent is assembled (the host probe,
the resctrl filesystem, the API client, the runtime connection, the endpoints, thread pools) and
nothing built then reads them again. Their value at start therefore stays in force until the
next start: the configuration store keeps it in the configuration it hands out
(:func:`hold_start_values`), so every part of the agent, ``nri-qos status`` included, works with
the one value that is in force instead of some parts with the start value and others with the
reloaded one (a resctrl class group named with one ``group_prefix`` and looked up with another).
A reload that changes one of them is said (``config_restart_needed``, with
:func:`restart_needed`); the rest of the reload applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nri_plugin.config.schema import Config


@dataclass(frozen=True, slots=True)
class StartOnly:
    """One key (dotted path) read at start, and why."""

    key: str
    why: str
    # A switch of a part the agent builds at start only when it is on: off at start, it stays
    # off until the next start; on at start, reloads switch the part off and on again.
    switch: bool = False

    def held(self, start: Config) -> bool:
        """Whether the value at start stays in force, for an agent started with ``start``."""
        return not self.switch or not value_at(start, self.key)


START_ONLY: tuple[StartOnly, ...] = (
    StartOnly("agent.scheduling", "set on the process before any thread starts; every thread "
              "inherits it"),
    StartOnly("plugin.name", "the identity registered with the runtime"),
    StartOnly("plugin.index", "the identity registered with the runtime"),
    StartOnly("plugin.socket", "the socket the connection (and every reconnect) uses"),
    StartOnly("plugin.reconnect_initial_ms", "the reconnect backoff is made once"),
    StartOnly("plugin.reconnect_max_ms", "the reconnect backoff is made once"),
    StartOnly("resctrl.enabled", "the resctrl filesystem, its capability and its loop are made "
              "only when it is on at start", switch=True),
    StartOnly("resctrl.root", "the resctrl filesystem is probed and opened there"),
    StartOnly("resctrl.group_prefix", "the resctrl filesystem names and finds the agent's groups "
              "by it; changed, the groups made with the old one would be left behind"),
    StartOnly("resctrl.amd_mb_max", "the resctrl probe scales AMD memory bandwidth by it"),
    StartOnly("memory.cgroup_version", "the host probe fixes the cgroup layout"),
    StartOnly("memory_guard.numa_view_tolerance_percent", "the host probe judges once whether "
              "the NUMA nodes add up to the machine; detection's numa_free and the features "
              "`nri-qos status` shows keep that judgement, so the memory guard's own check "
              "keeps the same tolerance"),
    StartOnly("reconciler.enabled", "the reconciler, the pod watch, detection, the mitigation "
              "ladder and the eviction manager are made only when it is on at start",
              switch=True),
    StartOnly("reconciler.root", "the host probe and every /sys and /proc path are rooted there"),
    StartOnly("reconciler.cgroup_driver", "the host probe fixes the cgroup layout"),
    StartOnly("reconciler.write_retries", "the file layer that retries writes is made once"),
    StartOnly("reconciler.state_dir", "the state file is opened once"),
    StartOnly("mitigation.drop_cache.workers", "the drop-cache thread pool is made once"),
    StartOnly("kubernetes.enabled", "the API client is made once"),
    StartOnly("kubernetes.kubeconfig", "the API client's credentials are read once"),
    StartOnly("kubernetes.node_name", "the node the watch, taints and evictions are about"),
    StartOnly("kubernetes.request_timeout_s", "the API client and its callers are made once"),
    StartOnly("kubernetes.watch_timeout_s", "the pod watch is made once"),
    StartOnly("kubernetes.retry_max_s", "the pod watch is made once"),
    StartOnly("metrics.enabled", "the metrics endpoint is started or not at start"),
    StartOnly("metrics.address", "the metrics endpoint binds once"),
    StartOnly("metrics.port", "the metrics endpoint binds once"),
    StartOnly("status.enabled", "the status socket is started or not at start"),
    StartOnly("status.socket", "the status socket binds once"),
)
"""Every key the running agent reads at start only."""


def value_at(cfg: Any, key: str) -> Any:
    """The value of the dotted ``key`` in ``cfg``."""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _with_value(cfg: Any, names: list[str], value: Any) -> Any:
    head, rest = names[0], names[1:]
    inner = value if not rest else _with_value(getattr(cfg, head), rest, value)
    return dataclasses.replace(cfg, **{head: inner})


def hold_start_values(start: Config, cfg: Config) -> Config:
    """``cfg`` with the value at start of every key held from ``start``."""
    for entry in START_ONLY:
        if entry.held(start) and value_at(cfg, entry.key) != value_at(start, entry.key):
            cfg = _with_value(cfg, entry.key.split("."), value_at(start, entry.key))
    return cfg


def restart_needed(start: Config, cfg: Config) -> Mapping[str, tuple[Any, Any]]:
    """The keys held from ``start`` that ``cfg`` sets otherwise: key -> (value in force, value
    of ``cfg``), in the order of :data:`START_ONLY`."""
    return {entry.key: (value_at(start, entry.key), value_at(cfg, entry.key))
            for entry in START_ONLY
            if entry.held(start) and value_at(cfg, entry.key) != value_at(start, entry.key)}
