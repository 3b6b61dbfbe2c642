"""Config store: initial load, reload on change and on request (SIGHUP), rejection of bad files,
the keys read at start only held at their value at start and said."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink, level_of
from hooks.config_fields import meta_of
from nri_plugin.config.loader import ConfigError
from nri_plugin.config.schema import Config
from nri_plugin.config.start_only import START_ONLY, value_at
from nri_plugin.config.store import EMBEDDED_DEFAULTS, ConfigStore, load_config

HANG_GUARD_S = 10.0  # only stops a broken test from hanging; never a timing assertion


def replace_file(path: Path, text: str) -> None:
    """Write as editors and ConfigMap volumes do: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class NotifyingSink(MemoryAuditSink):
    def __init__(self) -> None:
        super().__init__()
        self.recorded = asyncio.Event()

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None:
        super().__call__(event, fields)
        self.recorded.set()


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.sink = NotifyingSink()
        self.path = tmp_path / "config.toml"
        self.store = ConfigStore(AuditLog(self.sink), default_path=str(tmp_path / "absent.toml"))
        self.swaps: list[tuple[Config, Config]] = []
        self.swapped = asyncio.Event()
        self.store.subscribe(self._on_swap)

    def _on_swap(self, old: Config, new: Config) -> None:
        self.swaps.append((old, new))
        self.swapped.set()

    def audited(self) -> list[str]:
        return [name for name, _ in self.sink.records]

    async def wait_for_record(self, name: str, count: int = 1) -> None:
        while self.audited().count(name) < count:
            self.sink.recorded.clear()
            await asyncio.wait_for(self.sink.recorded.wait(), HANG_GUARD_S)


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


@pytest.fixture
async def watching(h: Harness) -> AsyncIterator[Harness]:
    """The harness with a loaded file and ``watch`` running (short poll interval)."""
    replace_file(h.path, "[plugin]\ndeadline_ms = 1000\n")
    h.store.load_initial(str(h.path))
    h.swapped.clear()
    stop = asyncio.Event()
    task = asyncio.create_task(h.store.watch(stop, interval_s=0.01))
    yield h
    stop.set()
    await asyncio.wait_for(task, HANG_GUARD_S)


# --- initial load -------------------------------------------------------------------------------

def test_missing_default_file_means_embedded_defaults(h: Harness) -> None:
    assert h.store.load_initial(None) == Config()
    assert h.store.source == EMBEDDED_DEFAULTS
    assert h.sink.records == [("config_loaded", {"source": EMBEDDED_DEFAULTS, "changed": False})]
    assert h.swaps == []


def test_missing_explicit_file_is_an_error(h: Harness) -> None:
    with pytest.raises(ConfigError) as info:
        h.store.load_initial(str(h.path))
    assert info.value.lines() == [f"{h.path}: cannot read: No such file or directory"]
    ((name, fields),) = h.sink.records
    assert name == "config_rejected"
    assert fields["source"] == str(h.path)
    assert fields["drop_ins"] == f"{h.path}.d"
    assert fields["errors"] == [f"{h.path}: cannot read: No such file or directory"]


def test_initial_file_is_loaded_and_announced(h: Harness) -> None:
    replace_file(h.path, "[plugin]\nstrict = true\n")
    cfg = h.store.load_initial(str(h.path))
    assert cfg.plugin.strict
    assert h.store.current is cfg
    assert h.store.source == str(h.path)
    assert h.swaps == [(Config(), cfg)]
    assert h.sink.records == [("config_loaded", {"source": str(h.path), "changed": True})]


def test_invalid_initial_file_raises_and_is_audited(h: Harness) -> None:
    replace_file(h.path, "[oom.levels.reclaimed_cores]\nscore = 5000\n")
    with pytest.raises(ConfigError):
        h.store.load_initial(str(h.path))
    assert h.store.current == Config()
    (rejected,) = h.sink.named("config_rejected")
    assert rejected["source"] == str(h.path)
    assert rejected["errors"] == [
        f"{h.path}: oom.levels.reclaimed_cores.score: must be -1000..1000, got 5000"]


def test_reload_before_load_initial_is_a_programming_error(h: Harness) -> None:
    with pytest.raises(RuntimeError, match="load_initial"):
        h.store.reload()


# --- reload -------------------------------------------------------------------------------------

def test_good_file_swaps(h: Harness) -> None:
    replace_file(h.path, "[plugin]\ndeadline_ms = 1000\n")
    first = h.store.load_initial(str(h.path))
    replace_file(h.path, "[plugin]\ndeadline_ms = 800\n")
    assert h.store.changed_on_disk()
    assert h.store.reload() is True
    assert h.store.current.plugin.deadline_ms == 800
    assert h.swaps[-1] == (first, h.store.current)
    assert h.sink.records[-1] == ("config_loaded", {"source": str(h.path), "changed": True})
    assert not h.store.changed_on_disk()


def test_bad_file_keeps_the_old_config_and_says_why(h: Harness) -> None:
    replace_file(h.path, "[plugin]\ndeadline_ms = 1000\n")
    good = h.store.load_initial(str(h.path))
    replace_file(h.path, "[memory.levels.reclaimed_cores]\nhigh_ratio = 140\n[plugin\n")
    with capture_logs() as logs:
        assert h.store.reload() is False
    assert h.store.current is good
    assert len(h.swaps) == 1
    (rejected,) = h.sink.named("config_rejected")
    assert rejected["source"] == str(h.path)
    assert len(rejected["errors"]) == 1
    assert rejected["errors"][0].startswith(f"{h.path}: invalid TOML: ")
    assert "previous configuration stays in force" in rejected["hint"]
    # Said once, by the audit record: no second line with other keys.
    assert logs == []
    # The rejected version is remembered: it is not re-read until it changes again.
    assert not h.store.changed_on_disk()


def test_invalid_values_are_listed_one_per_error(h: Harness) -> None:
    replace_file(h.path, "")
    h.store.load_initial(str(h.path))
    replace_file(h.path, "[memory.levels.reclaimed_cores]\nhigh_ratio = 140\n"
                         "[plugin]\nstrict = \"yes\"\n")
    assert h.store.reload() is False
    assert h.sink.named("config_rejected")[0]["errors"] == [
        f"{h.path}: plugin.strict: must be a boolean, got string",
        f"{h.path}: memory.levels.reclaimed_cores.high_ratio: must be 0..100, got 140",
    ]


def test_unchanged_content_is_confirmed_without_a_swap(h: Harness) -> None:
    replace_file(h.path, "[plugin]\nstrict = true\n")
    h.store.load_initial(str(h.path))
    replace_file(h.path, "[plugin]\nstrict = true  # same value\n")
    assert h.store.reload() is False
    assert len(h.swaps) == 1
    assert h.sink.records[-1] == ("config_loaded", {"source": str(h.path), "changed": False})


def test_default_file_appearing_and_disappearing(h: Harness, tmp_path: Path) -> None:
    default = tmp_path / "absent.toml"
    h.store.load_initial(None)
    replace_file(default, "[plugin]\nstrict = true\n")
    assert h.store.changed_on_disk()
    assert h.store.reload() is True
    assert h.store.current.plugin.strict
    assert h.store.source == str(default)
    default.unlink()
    assert h.store.reload() is True
    assert h.store.current == Config()
    assert h.sink.records[-1] == ("config_loaded", {"source": EMBEDDED_DEFAULTS, "changed": True})


def test_explicit_file_disappearing_keeps_the_config(h: Harness) -> None:
    replace_file(h.path, "[plugin]\nstrict = true\n")
    h.store.load_initial(str(h.path))
    h.path.unlink()
    assert h.store.reload() is False
    assert h.store.current.plugin.strict
    assert h.sink.named("config_rejected")[-1]["errors"] == [
        f"{h.path}: cannot read: No such file or directory"
    ]


def test_a_failing_subscriber_does_not_stop_the_others(h: Harness) -> None:
    def broken(old: Config, new: Config) -> None:
        raise RuntimeError("boom")

    seen: list[Config] = []
    h.store.subscribe(broken)
    h.store.subscribe(lambda old, new: seen.append(new))
    replace_file(h.path, "[plugin]\nstrict = true\n")
    with capture_logs() as logs:
        h.store.load_initial(str(h.path))
    assert seen == [h.store.current]
    assert [e["event"] for e in logs] == ["config_subscriber_failed"]
    assert h.sink.named("config_loaded") == [{"source": str(h.path), "changed": True}]


def test_unsubscribe(h: Harness) -> None:
    seen: list[Config] = []
    unsubscribe = h.store.subscribe(lambda old, new: seen.append(new))
    unsubscribe()
    replace_file(h.path, "[plugin]\nstrict = true\n")
    h.store.load_initial(str(h.path))
    assert seen == []


# --- watch --------------------------------------------------------------------------------------

async def test_watch_picks_up_a_changed_file(watching: Harness) -> None:
    h = watching
    h.swapped.clear()
    replace_file(h.path, "[plugin]\ndeadline_ms = 700\n")
    await asyncio.wait_for(h.swapped.wait(), HANG_GUARD_S)
    assert h.store.current.plugin.deadline_ms == 700


async def test_watch_rejects_a_bad_file_once_then_takes_the_fix(watching: Harness) -> None:
    h = watching
    before = h.store.current
    replace_file(h.path, "[plugin]\ndeadline_ms = -1\n")
    with capture_logs():
        await h.wait_for_record("config_rejected")
    assert h.store.current is before
    h.swapped.clear()
    replace_file(h.path, "[plugin]\ndeadline_ms = 600\n")
    await asyncio.wait_for(h.swapped.wait(), HANG_GUARD_S)
    assert h.store.current.plugin.deadline_ms == 600
    assert h.audited().count("config_rejected") == 1


async def test_request_reload_rereads_without_waiting_for_a_poll(h: Harness) -> None:
    replace_file(h.path, "[plugin]\ndeadline_ms = 1000\n")
    h.store.load_initial(str(h.path))
    h.swapped.clear()
    stop = asyncio.Event()
    # A poll interval far beyond the hang guard: only the request can trigger the reload.
    task = asyncio.create_task(h.store.watch(stop, interval_s=3600))
    replace_file(h.path, "[plugin]\ndeadline_ms = 900\n")
    h.store.request_reload()
    await asyncio.wait_for(h.swapped.wait(), HANG_GUARD_S)
    assert h.store.current.plugin.deadline_ms == 900
    stop.set()
    await asyncio.wait_for(task, HANG_GUARD_S)


async def test_sighup_reloads(h: Harness) -> None:
    replace_file(h.path, "[plugin]\ndeadline_ms = 1000\n")
    h.store.load_initial(str(h.path))
    h.swapped.clear()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    task = asyncio.create_task(h.store.watch(stop, interval_s=3600))
    loop.add_signal_handler(signal.SIGHUP, h.store.request_reload)
    try:
        h.store.request_reload()  # the same request, once without a signal ...
        await h.wait_for_record("config_loaded", 2)
        assert h.sink.records[-1] == ("config_loaded", {"source": str(h.path), "changed": False})
        replace_file(h.path, "[plugin]\ndeadline_ms = 500\n")
        os.kill(os.getpid(), signal.SIGHUP)  # ... and once through the real signal
        await asyncio.wait_for(h.swapped.wait(), HANG_GUARD_S)
        assert h.store.current.plugin.deadline_ms == 500
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        stop.set()
        await asyncio.wait_for(task, HANG_GUARD_S)


async def test_watch_stops_promptly(h: Harness) -> None:
    h.store.load_initial(None)
    stop = asyncio.Event()
    task = asyncio.create_task(h.store.watch(stop, interval_s=3600))
    await asyncio.sleep(0)
    stop.set()
    await asyncio.wait_for(task, HANG_GUARD_S)
    already = asyncio.Event()
    already.set()
    await asyncio.wait_for(h.store.watch(already), HANG_GUARD_S)


async def test_watch_polls_on_the_injected_clock(tmp_path: Path) -> None:
    """With a clock that never reaches the next check, a changed file is left alone."""
    sink = MemoryAuditSink()
    store = ConfigStore(AuditLog(sink), clock=lambda: 0.0)
    path = tmp_path / "c.toml"
    replace_file(path, "")
    store.load_initial(str(path))
    replace_file(path, "[plugin]\nstrict = true\n")
    stop = asyncio.Event()
    task = asyncio.create_task(store.watch(stop, interval_s=0.001))
    for _ in range(20):
        await asyncio.sleep(0.002)
    assert not store.current.plugin.strict
    swapped = asyncio.Event()
    store.subscribe(lambda old, new: swapped.set())
    store.request_reload()
    await asyncio.wait_for(swapped.wait(), HANG_GUARD_S)
    assert store.current.plugin.strict
    stop.set()
    await asyncio.wait_for(task, HANG_GUARD_S)


async def test_watch_rejects_a_non_positive_interval(h: Harness) -> None:
    h.store.load_initial(None)
    with pytest.raises(ValueError, match="interval_s"):
        await h.store.watch(asyncio.Event(), interval_s=0)


# --- keys read at start only --------------------------------------------------------------------

RELOADED = {
    "agent.scheduling": ('[agent]\nscheduling = "batch"\n', "batch"),
    "plugin.name": ('[plugin]\nname = "other"\n', "other"),
    "plugin.index": ('[plugin]\nindex = "20"\n', "20"),
    "plugin.socket": ('[plugin]\nsocket = "/run/other/nri.sock"\n', "/run/other/nri.sock"),
    "plugin.reconnect_initial_ms": ("[plugin]\nreconnect_initial_ms = 501\n", 501),
    "plugin.reconnect_max_ms": ("[plugin]\nreconnect_max_ms = 30001\n", 30001),
    "resctrl.enabled": ("[resctrl]\nenabled = true\n", True),
    "resctrl.root": ('[resctrl]\nroot = "/mnt/resctrl"\n', "/mnt/resctrl"),
    "resctrl.group_prefix": ('[resctrl]\ngroup_prefix = "other-"\n', "other-"),
    "resctrl.amd_mb_max": ("[resctrl]\namd_mb_max = 2049\n", 2049),
    "memory.cgroup_version": ('[memory]\ncgroup_version = "v2"\n', "v2"),
    "memory_guard.numa_view_tolerance_percent": (
        "[memory_guard]\nnuma_view_tolerance_percent = 20.0\n", 20.0),
    "reconciler.enabled": ("[reconciler]\nenabled = true\n", True),
    "reconciler.root": ('[reconciler]\nroot = "/host"\n', "/host"),
    "reconciler.cgroup_driver": ('[reconciler]\ncgroup_driver = "systemd"\n', "systemd"),
    "reconciler.write_retries": ("[reconciler]\nwrite_retries = 4\n", 4),
    "reconciler.state_dir": ('[reconciler]\nstate_dir = ""\n', ""),
    "mitigation.drop_cache.workers": ("[mitigation.drop_cache]\nworkers = 3\n", 3),
    "kubernetes.enabled": ("[kubernetes]\nenabled = false\n", False),
    "kubernetes.kubeconfig": ('[kubernetes]\nkubeconfig = "/etc/kube.conf"\n',
                              "/etc/kube.conf"),
    "kubernetes.node_name": ('[kubernetes]\nnode_name = "node-b"\n', "node-b"),
    "kubernetes.request_timeout_s": ("[kubernetes]\nrequest_timeout_s = 10.5\n", 10.5),
    "kubernetes.watch_timeout_s": ("[kubernetes]\nwatch_timeout_s = 301\n", 301),
    "kubernetes.retry_max_s": ("[kubernetes]\nretry_max_s = 30.5\n", 30.5),
    "metrics.enabled": ("[metrics]\nenabled = true\n", True),
    "metrics.address": ('[metrics]\naddress = "0.0.0.0"\n', "0.0.0.0"),
    "metrics.port": ("[metrics]\nport = 9465\n", 9465),
    "status.enabled": ("[status]\nenabled = false\n", False),
    "status.socket": ('[status]\nsocket = "/run/other/status.sock"\n', "/run/other/status.sock"),
}
"""A reload's file changing each start-only key, and the value it gives the key."""

SWITCHES = {entry.key for entry in START_ONLY if entry.switch}


def start_text(key: str) -> str:
    """The file the agent starts with: a switch off (else it is not held), the rest default."""
    if key in SWITCHES:
        section, name = key.rsplit(".", 1)
        return f"[{section}]\n{name} = false\n"
    return ""


def test_every_start_only_key_is_reloaded_below() -> None:
    assert set(RELOADED) == {entry.key for entry in START_ONLY}


def test_every_setting_said_to_be_read_at_start_is_start_only() -> None:
    def said(section: Any, prefix: str) -> Iterator[str]:
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if dataclasses.is_dataclass(value):
                yield from said(value, f"{prefix}{f.name}.")
            elif "read at start" in meta_of(f).doc.lower():
                yield f"{prefix}{f.name}"

    found = set(said(Config(), ""))
    # The walk reaches nested sections.
    assert {"agent.scheduling", "mitigation.drop_cache.workers"} <= found
    assert found <= {entry.key for entry in START_ONLY}


LIVE = "[oom]\nenabled = false\n"
"""A key of none of the start-only keys' sections, which a reload applies."""


@pytest.mark.parametrize("key", sorted(RELOADED))
def test_a_reload_changing_a_start_only_key_keeps_its_value_and_says_so(
        h: Harness, key: str) -> None:
    text, new = RELOADED[key]
    replace_file(h.path, start_text(key))
    start = value_at(h.store.load_initial(str(h.path)), key)
    assert start != new
    replace_file(h.path, text + LIVE)
    assert h.store.reload() is True
    assert value_at(h.store.current, key) == start
    assert value_at(h.store.in_force, key) == start
    assert h.swaps[-1][1] is h.store.current
    assert not h.store.current.oom.enabled
    assert h.store.restart_needed == {key: (start, new)}
    (said,) = h.sink.named("config_restart_needed")
    assert said["source"] == str(h.path)
    assert said["keys"] == {key: {"in_force": start, "new": new}}
    assert h.audited()[-2:] == ["config_loaded", "config_restart_needed"]
    assert level_of("config_restart_needed") == "warning"


def test_a_reload_changing_only_start_only_keys_changes_nothing_in_force(h: Harness) -> None:
    replace_file(h.path, "")
    first = h.store.load_initial(str(h.path))
    replace_file(h.path, '[resctrl]\ngroup_prefix = "other-"\n[metrics]\nport = 9465\n')
    assert h.store.reload() is False
    assert h.store.current is first
    assert h.swaps == []
    assert h.sink.named("config_loaded")[-1] == {"source": str(h.path), "changed": False}
    (said,) = h.sink.named("config_restart_needed")
    assert said["keys"] == {"resctrl.group_prefix": {"in_force": "nriqos-", "new": "other-"},
                            "metrics.port": {"in_force": 9464, "new": 9465}}


def test_a_pending_key_is_said_once_per_change_and_forgotten_when_set_back(h: Harness) -> None:
    replace_file(h.path, "")
    h.store.load_initial(str(h.path))
    replace_file(h.path, "[metrics]\nport = 9465\n")
    h.store.reload()
    # Still in the files, beside a live change: not said again, still pending.
    replace_file(h.path, "[metrics]\nport = 9465\n" + LIVE)
    assert h.store.reload() is True
    assert len(h.sink.named("config_restart_needed")) == 1
    assert h.store.restart_needed == {"metrics.port": (9464, 9465)}
    # Another new value: said again, against the value in force.
    replace_file(h.path, "[metrics]\nport = 9466\n")
    h.store.reload()
    assert h.sink.named("config_restart_needed")[-1]["keys"] == {
        "metrics.port": {"in_force": 9464, "new": 9466}}
    # Back to the value in force: nothing pending, nothing said.
    replace_file(h.path, "[metrics]\nport = 9464\n")
    h.store.reload()
    assert h.store.restart_needed == {}
    assert len(h.sink.named("config_restart_needed")) == 2


@pytest.mark.parametrize(("start", "reloaded"), [
    ("", '[agent]\nmode = "enforce"\n[plugin]\ndeadline_ms = 1000\nstrict = true\n'),
    ("", "[resctrl.levels.reclaimed_cores]\nl3_end_percent = 50\n[resctrl]\npod_groups = false\n"),
    ("", "[memory]\nenabled = false\n[oom]\nenabled = false\n"),
    ("", '[logging]\nlevel = "debug"\n[reconciler]\ndrift_interval_s = 5.0\n'),
    # The switches of parts made at start: switched off and on again after a start with them on.
    ("", "[resctrl]\nenabled = false\n[reconciler]\nenabled = false\n"),
    ("[resctrl]\nenabled = false\n[reconciler]\nenabled = false\n", ""),
])
def test_a_reload_changing_live_keys_only_says_nothing(h: Harness, start: str,
                                                       reloaded: str) -> None:
    replace_file(h.path, "")
    h.store.load_initial(str(h.path))
    replace_file(h.path, start)
    assert h.store.reload() is bool(start)
    replace_file(h.path, reloaded)
    assert h.store.reload() is True
    assert h.store.current == load_config(str(h.path))[0]
    assert h.store.restart_needed == {}
    assert h.sink.named("config_restart_needed") == []
