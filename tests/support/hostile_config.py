"""Hostile configuration files: the tree each case writes, and the four ways a case is played.

Each case must say the same errors with the same key paths:

* the loader (:func:`load_file`);
* ``nri-qos check-config PATH``: exit status 1, one stderr line per error, nothing on stdout;
* the daemon (:func:`nri_plugin.cli.daemon.serve`): refuses to start, exit status 2, the errors in
  its ``config_invalid`` log line;
* a reload of a running configuration (:class:`ConfigStore`): refused, one ``config_rejected``
  audit record with the errors, the previous configuration still in force.

A case that must pass returns no errors: the loader, check-config and a reload accept it.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.cli import daemon, main
from nri_plugin.config.loader import MAX_ERROR_CHARS, ConfigError, load_file
from nri_plugin.config.schema import Config
from nri_plugin.config.store import ConfigStore

OTHER_UID = 1000
HOOK_KEY = "oci_hooks.levels.reclaimed_cores.prestart[0].path"
MONITOR_KEY = "resctrl.monitor_hook.path"
GOOD = "[plugin]\nstrict = true\n"


@dataclass(frozen=True)
class Starts:
    """An expected error known by its beginning (the rest is the TOML parser's wording)."""

    prefix: str


Expected = list[str | Starts]


class Tree:
    """Files under the test's own directory (root's, mode 0700): hooks, directories, links."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = root / "config.toml"

    def put(self, content: str | bytes) -> None:
        """Replace the configuration file with ``content``."""
        if self.config.is_dir():
            self.config.rmdir()
        self.config.unlink(missing_ok=True)
        if isinstance(content, str):
            content = content.encode()
        self.config.write_bytes(content)

    def exe(self, rel: str, *, mode: int = 0o755, uid: int = 0) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\nexit 0\n")
        os.chown(path, uid, uid)
        path.chmod(mode)
        return path

    def dir(self, rel: str, *, mode: int = 0o755, uid: int = 0) -> Path:
        path = self.root / rel
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, uid, uid)
        path.chmod(mode)
        return path

    def link(self, rel: str, target: str | Path, *, uid: int = 0) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)
        os.lchown(path, uid, uid)
        return path

    def hook(self, path: str | Path) -> None:
        self.put(f'[[oci_hooks.levels.reclaimed_cores.prestart]]\npath = "{path}"\n')


Case = Callable[[Tree], Expected]


def mode_text(mode: int, kind: int = stat.S_IFREG) -> str:
    return stat.filemode(kind | mode)


def matches(errors: list[str], expected: Expected) -> bool:
    if len(errors) != len(expected):
        return False
    return all(e.startswith(x.prefix) if isinstance(x, Starts) else e == x
               for e, x in zip(errors, expected, strict=True))


def in_file(path: Path, errors: list[str]) -> list[str]:
    """The errors without the file each one names, which must be ``path``."""
    where = f"{path}: "
    assert all(error.startswith(where) for error in errors), errors
    return [error.removeprefix(where) for error in errors]


def loader_names_every_problem(tree: Tree, case: Case) -> None:
    """The loader refuses the file with the case's errors, each of a bounded length."""
    expected = case(tree)
    if not expected:
        load_file(Config, tree.config)
        return
    with pytest.raises(ConfigError) as info:
        load_file(Config, tree.config)
    errors = list(info.value.errors)
    assert matches(errors, expected), errors
    assert info.value.source == str(tree.config)
    assert all(len(e) <= MAX_ERROR_CHARS + 64 for e in errors)


def check_config_names_every_problem(tree: Tree, case: Case,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``nri-qos check-config`` exits 1 with one stderr line per error and a count."""
    expected = case(tree)
    status = main(["check-config", str(tree.config)])
    captured = capsys.readouterr()
    if not expected:
        assert status == 0, captured.err
        assert captured.err == ""
        return
    assert status == 1
    assert captured.out == ""
    lines = captured.err.splitlines()
    where = f"{tree.config}: "
    assert all(line.startswith(where) for line in lines), lines
    assert matches([line.removeprefix(where) for line in lines[:-1]], expected), lines
    n = len(expected)
    assert lines[-1] == f"{where}invalid configuration ({n} error{'s' if n != 1 else ''})"


async def daemon_refuses_to_start(tree: Tree, case: Case,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The daemon exits 2 with the errors in its ``config_invalid`` log line, loading nothing."""
    expected = case(tree)
    status = await daemon.serve(str(tree.config), None, None, stop=asyncio.Event(),
                                prelaunched=None)
    assert status == 2
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    (refusal,) = [x for x in lines if x.get("event") == "config_invalid"]
    assert refusal["source"] == str(tree.config)
    assert matches(in_file(tree.config, refusal["errors"]), expected), refusal["errors"]
    assert not [x for x in lines if x.get("event") == "config_loaded"]


def reload_is_refused(tree: Tree, case: Case) -> None:
    """A reload is refused with one ``config_rejected`` record; the running configuration stays."""
    sink = MemoryAuditSink()
    store = ConfigStore(AuditLog(sink), default_path=str(tree.root / "absent.toml"))
    tree.put(GOOD)
    running = store.load_initial(str(tree.config))
    assert running.plugin.strict
    expected = case(tree)
    changed = store.reload()
    name, fields = sink.records[-1]
    if not expected:
        assert name == "config_loaded"
        assert store.current == load_file(Config, tree.config)
        assert changed == (store.current != running)
        return
    assert not changed
    assert store.current is running
    assert name == "config_rejected"
    assert fields["source"] == str(tree.config)
    assert matches(in_file(tree.config, fields["errors"]), expected), fields["errors"]
    assert [n for n, _ in sink.records].count("config_rejected") == 1
