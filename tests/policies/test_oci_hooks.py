"""OCI hooks: from the node config only, and only trusted executables."""

from __future__ import annotations

import os
from pathlib import Path
from types import MappingProxyType

import pytest

from hooks.oci_hooks import OciHooksConfig, any_hooks, level_hooks
from hooks.settings import HookStage, OciHookSpec
from nri_plugin.config.loader import ConfigError, parse_toml
from nri_plugin.config.schema import Config
from tests.support.builders import hook_executable


@pytest.fixture
def tool(tmp_path: Path) -> Path:
    return hook_executable(tmp_path / "hook.sh")


def load(text: str) -> Config:
    config: Config = parse_toml(Config, text)
    return config


def test_hooks_of_a_level_in_stage_order(tool: Path) -> None:
    cfg = load(f"""
[[oci_hooks.levels.reclaimed_cores.poststop]]
path = "{tool}"
[[oci_hooks.levels.reclaimed_cores.prestart]]
path = "{tool}"
args = ["hook.sh", "--x"]
env = ["A=1"]
timeout_s = 5
[[oci_hooks.levels.reclaimed_cores.prestart]]
path = "{tool}"
[[oci_hooks.levels.reclaimed_cores.create_runtime]]
path = "{tool}"
""")
    hooks = level_hooks("reclaimed_cores", cfg.oci_hooks)
    assert hooks == (
        OciHookSpec(HookStage.PRESTART, str(tool), ("hook.sh", "--x"), ("A=1",), 5),
        OciHookSpec(HookStage.PRESTART, str(tool)),
        OciHookSpec(HookStage.CREATE_RUNTIME, str(tool)),
        OciHookSpec(HookStage.POSTSTOP, str(tool)),
    )
    assert level_hooks("shared_cores", cfg.oci_hooks) == ()
    assert any_hooks(cfg.oci_hooks)
    assert not any_hooks(OciHooksConfig())


def test_every_stage_maps(tool: Path) -> None:
    stages = ["prestart", "create_runtime", "create_container", "start_container", "poststart",
              "poststop"]
    text = "".join(f'[[oci_hooks.levels.shared_cores.{s}]]\npath = "{tool}"\n' for s in stages)
    hooks = level_hooks("shared_cores", load(text).oci_hooks)
    assert [h.stage.value for h in hooks] == stages


def test_policy_takes_no_pod_input() -> None:
    # Annotations cannot add hooks: the policy has no way to see them.
    import inspect
    assert list(inspect.signature(level_hooks).parameters) == ["level_name", "cfg"]
    assert level_hooks("reclaimed_cores", OciHooksConfig(levels=MappingProxyType({}))) == ()


def _expect_error(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(text)
    assert any(needle in e for e in err.value.errors), err.value.errors
    assert any(e.startswith("oci_hooks.levels.reclaimed_cores.prestart[0].path")
               for e in err.value.errors), err.value.errors


def _hook_at(path: str) -> str:
    return f'[[oci_hooks.levels.reclaimed_cores.prestart]]\npath = "{path}"\n'


def test_relative_path_rejected() -> None:
    _expect_error(_hook_at("bin/hook"), "must be an absolute path")


def test_missing_path_rejected(tmp_path: Path) -> None:
    _expect_error(_hook_at(str(tmp_path / "nope")), "No such file")


def test_directory_rejected(tmp_path: Path) -> None:
    _expect_error(_hook_at(str(tmp_path)), "not a regular file")


def test_not_executable_rejected(tool: Path) -> None:
    tool.chmod(0o644)
    _expect_error(_hook_at(str(tool)), "not executable")


def test_not_root_owned_rejected(tool: Path) -> None:
    os.chown(tool, 1000, 1000)
    _expect_error(_hook_at(str(tool)), "must be owned by root")


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777])
def test_group_or_world_writable_rejected(tool: Path, mode: int) -> None:
    tool.chmod(mode)
    _expect_error(_hook_at(str(tool)), "must not be group- or world-writable")


def test_unknown_level_and_keys_rejected(tool: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        load(f'[[oci_hooks.levels.bogus.prestart]]\npath = "{tool}"\n')
    with pytest.raises(ConfigError, match="unknown key"):
        load(f'[[oci_hooks.levels.shared_cores.prestart]]\npath = "{tool}"\nshell = true\n')


def test_monitor_hook_path_checked_only_when_enabled(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    load(f'[resctrl.monitor_hook]\npath = "{missing}"\n')
    with pytest.raises(ConfigError, match=r"resctrl\.monitor_hook\.path"):
        load(f'[resctrl.monitor_hook]\nenabled = true\npath = "{missing}"\n')
