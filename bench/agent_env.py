"""The agent's interpreter as the image installs it (``pip install .``): only the source tree's
runtime dependencies, and theirs, importable.

A development environment has the test tools installed too, and one of them brings ``rich``,
which ``structlog`` imports whenever it can: 3.7 MiB of anonymous memory an agent on a node
does not carry, and a benchmark of what the agent costs a node must not charge. The agent
runs with ``python -S`` (no site-packages) and a directory of links to exactly the
distributions ``pip install`` would bring, resolved from the tree's ``pyproject.toml`` and
the installed distributions' metadata (no network: the guests have none).
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from collections.abc import Iterable
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement


def closure(requirements: Iterable[str]) -> list[Distribution]:
    """The installed distributions ``requirements`` need, theirs included, extras left out."""
    found: dict[str, Distribution] = {}
    pending = [Requirement(text) for text in requirements]
    while pending:
        requirement = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        key = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if key in found:
            continue
        try:
            found[key] = distribution(requirement.name)
        except PackageNotFoundError as exc:
            raise RuntimeError(f"{requirement.name} is not installed; install the tree "
                               f"(pip install -e .) first") from exc
        pending.extend(Requirement(text) for text in found[key].requires or ())
    return sorted(found.values(), key=lambda d: d.metadata["Name"].lower())


def runtime_links(source: Path, into: Path) -> Path:
    """A directory of links to the top-level modules and metadata of the distributions
    ``source``'s ``pip install`` would bring."""
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    into.mkdir(parents=True, exist_ok=True)
    for dist in closure(project["dependencies"]):
        for top in {Path(str(f)).parts[0] for f in dist.files or ()} - {"..", "__pycache__"}:
            link = into / top
            target = Path(str(dist.locate_file(top)))
            if not link.exists() and target.exists():
                link.symlink_to(target)
    return into


def agent_command(source: Path, scratch: Path, *,
                  profile: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The start of the command that runs ``python -m nri_plugin`` of ``source`` (run it
    with ``source`` as its working directory) and the environment it needs; with ``profile``,
    every thread of it profiled into that directory (``bench/agent_profile.py``)."""
    links = runtime_links(source, scratch / "site")
    env = {**os.environ, "PYTHONPATH": str(links)}
    if profile is not None:
        runner = Path(__file__).with_name("agent_profile.py")
        return [sys.executable, "-S", str(runner), "profile", str(profile), "nri_plugin"], env
    return [sys.executable, "-S", "-m", "nri_plugin"], env
