"""``nri-qos check-config``: validate the configuration files, print the effective configuration
(with where each non-default value came from) or every error."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from nri_plugin.config.loader import ConfigError, Layered
from nri_plugin.config.render import render_toml, toml_value
from nri_plugin.config.schema import Config
from nri_plugin.config.store import DEFAULT_CONFIG_PATH, load_layered


def check_config(path: str | None) -> int:
    try:
        layered = load_layered(path)
    except ConfigError as exc:
        lines = exc.lines()
        for line in lines:
            print(line, file=sys.stderr)
        print(f"{path or DEFAULT_CONFIG_PATH}: invalid configuration ({len(lines)} "
              f"error{'s' if len(lines) != 1 else ''})", file=sys.stderr)
        return 1
    if not layered.files:
        print(f"no file at {DEFAULT_CONFIG_PATH} nor in {DEFAULT_CONFIG_PATH}.d: the embedded "
              "defaults apply", file=sys.stderr)
    # Comments, so that the whole output stays a configuration file.
    for line in origin_lines(layered):
        sys.stdout.write(f"# {line}\n")
    sys.stdout.write(render_toml(layered.config, commented=False))
    return 0


def origin_lines(layered: Layered) -> list[str]:
    """``key = value  (file)`` for every value a file set to other than its default (none when
    the files only repeat defaults)."""
    defaults = Config()
    found = [f"{'.'.join(key)} = {toml_value(_at(layered.data, key))}  ({source})"
             for key, source in layered.origins.items()
             if _at(layered.config, key) != _at(defaults, key)]
    if not found:
        return []
    return ["values set by the files, where they differ from the defaults:",
            *(f"  {line}" for line in found)]


def _at(obj: Any, key: tuple[str, ...]) -> Any:
    """The value at ``key`` in a config object or a parsed document; None where there is none
    (a table key the defaults do not have)."""
    for part in key:
        obj = obj.get(part) if isinstance(obj, Mapping) else getattr(obj, part, None)
        if obj is None:
            return None
    return obj
