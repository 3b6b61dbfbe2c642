"""The benchmarks run the agent with what the image installs and nothing else: the tree's
runtime dependencies and theirs, never a development tool that a library would pick up."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from bench.agent_env import agent_command, closure
from tests.support.paths import REPO


def names(requirements: list[str]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in closure(requirements)}


def test_the_closure_follows_dependencies_and_leaves_extras_out() -> None:
    found = names(["structlog", "rich; extra == 'dev'", "grpcio"])
    assert {"structlog", "grpcio"} <= found
    assert "rich" not in found
    assert "typing-extensions" in names(["grpcio"])


def test_a_dependency_not_installed_is_named() -> None:
    with pytest.raises(RuntimeError, match="no-such-distribution is not installed"):
        closure(["no-such-distribution>=1"])


def test_the_agent_imports_as_on_a_node(tmp_path: Path) -> None:
    command, env = agent_command(REPO, tmp_path)
    assert command[1:] == ["-S", "-m", "nri_plugin"]
    probe = ("import sys, nri_plugin.agent, structlog\n"
             "print(sorted({m.split('.')[0] for m in sys.modules} & "
             "{'rich', 'kubernetes', 'pytest', 'hypothesis', 'yaml', 'urllib3', 'grpc'}))")
    done = subprocess.run([command[0], "-S", "-c", probe], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)
    # grpc is imported only where an eviction plugin is configured; yaml with a kubeconfig
    assert done.stdout.split("\n")[0] == "['urllib3', 'yaml']"
