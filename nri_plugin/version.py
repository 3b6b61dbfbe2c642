"""The installed agent's version, for ``nri-qos --version`` and the status document."""

from __future__ import annotations

from importlib import metadata


def agent_version() -> str:
    """The installed nri-qos version; a text saying so when the package is not installed."""
    try:
        return metadata.version("nri-qos")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"
