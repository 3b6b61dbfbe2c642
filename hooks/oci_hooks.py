"""OCI hooks policy: the hooks a container gets come from the node config of its level only.

The function takes no pod input at all, so no annotation can ever add, change or remove a hook.
Hook executables were checked when the config was loaded (absolute path, a regular executable
file owned by root and writable by nobody else; see ``check_hook_path``).
"""

from __future__ import annotations

from hooks.settings import HookStage, OciHookSpec
from nri_plugin.config.creation import OciHook, OciHooksConfig, OciLevelHooks

_STAGES: tuple[tuple[HookStage, str], ...] = (
    (HookStage.PRESTART, "prestart"),
    (HookStage.CREATE_RUNTIME, "create_runtime"),
    (HookStage.CREATE_CONTAINER, "create_container"),
    (HookStage.START_CONTAINER, "start_container"),
    (HookStage.POSTSTART, "poststart"),
    (HookStage.POSTSTOP, "poststop"),
)


def _spec(stage: HookStage, hook: OciHook) -> OciHookSpec:
    return OciHookSpec(stage=stage, path=hook.path, args=hook.args, env=hook.env,
                       timeout_s=hook.timeout_s or None)


def level_hooks(level_name: str, cfg: OciHooksConfig) -> tuple[OciHookSpec, ...]:
    """Every configured hook of ``level_name``, in stage order then config order."""
    level: OciLevelHooks | None = cfg.levels.get(level_name)
    if level is None:
        return ()
    return tuple(_spec(stage, hook) for stage, attr in _STAGES for hook in getattr(level, attr))


def any_hooks(cfg: OciHooksConfig) -> bool:
    return any(level_hooks(name, cfg) for name in cfg.levels)
