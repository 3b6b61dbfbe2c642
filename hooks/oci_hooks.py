"""OCI hooks policy: the hooks a container gets come from the node config of its level only.

The function takes no pod input at all, so no annotation can ever add, change or remove a hook.
Hook executables were checked when the config was loaded (absolute path, a regular executable
file owned by root and writable by nobody else; see ``check_hook_path``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hooks.config_fields import setting
from hooks.levels import LEVEL_NAMES
from hooks.settings import HookStage, OciHookSpec


@dataclass(frozen=True, slots=True)
class OciHook:
    path: str = setting("", "Absolute path of the hook executable.")
    args: tuple[str, ...] = setting((), "argv of the hook (argv[0] included, as in OCI).")
    env: tuple[str, ...] = setting((), "Environment, KEY=VALUE.")
    timeout_s: int = setting(0, "Timeout; 0 means none.", unit="seconds", minimum=0, maximum=3600)


@dataclass(frozen=True, slots=True)
class OciLevelHooks:
    prestart: tuple[OciHook, ...] = setting((), "prestart hooks.")
    create_runtime: tuple[OciHook, ...] = setting((), "createRuntime hooks.")
    create_container: tuple[OciHook, ...] = setting((), "createContainer hooks.")
    start_container: tuple[OciHook, ...] = setting((), "startContainer hooks.")
    poststart: tuple[OciHook, ...] = setting((), "poststart hooks.")
    poststop: tuple[OciHook, ...] = setting((), "poststop hooks.")


@dataclass(frozen=True, slots=True)
class OciHooksConfig:
    levels: Mapping[str, OciLevelHooks] = setting(
        {}, "Hooks per QoS level, e.g. [[oci_hooks.levels.reclaimed_cores.prestart]].",
        keys=LEVEL_NAMES,
    )


def _spec(stage: HookStage, hook: OciHook) -> OciHookSpec:
    return OciHookSpec(stage=stage, path=hook.path, args=hook.args, env=hook.env,
                       timeout_s=hook.timeout_s or None)


def level_hooks(level_name: str, cfg: OciHooksConfig) -> tuple[OciHookSpec, ...]:
    """Every configured hook of ``level_name``, in stage order then config order."""
    level: OciLevelHooks | None = cfg.levels.get(level_name)
    if level is None:
        return ()
    # Each stage's hooks are the OciLevelHooks field named by the stage's value.
    return tuple(_spec(stage, hook) for stage in HookStage
                 for hook in getattr(level, stage.value))


def any_hooks(cfg: OciHooksConfig) -> bool:
    return any(level_hooks(name, cfg) for name in cfg.levels)
