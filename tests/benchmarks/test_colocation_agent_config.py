"""``bench/colocation.py --agent-config``: settings over the defaults for both agent modes, as
a drop-in of the agent's configuration, checked before any run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.colocation_agent import Agent
from bench.colocation_cli import parser, settings_from
from bench.kubelet_node import KubeletNode
from nri_plugin.config.loader import drop_ins, load_layers
from nri_plugin.config.schema import Config

PROTECT = "[memory.levels.shared_cores]\npolicy = \"ratios\"\nmin_ratio = 100\n"


def test_the_file_reaches_both_agent_modes_over_the_benchmarks_settings(tmp_path: Path) -> None:
    given = tmp_path / "protect.toml"
    given.write_text(PROTECT + "[detection]\nenabled = true\n")
    settings, _ = settings_from(parser("").parse_args(["--agent-config", str(given)]),
                                23 * 1024, v2=True)
    assert settings.agent_config == given.read_text()
    for creation_only in (False, True):
        work = tmp_path / f"agent-{creation_only}"
        work.mkdir()
        agent = Agent(KubeletNode.__new__(KubeletNode), work, Path("."),
                      creation_only=creation_only, drop_in=settings.agent_config)
        config = agent.write_config(tmp_path, tmp_path / "kubeconfig")
        loaded = load_layers(Config, [config, *drop_ins(config)]).config
        level = loaded.memory.levels["shared_cores"]
        assert (level.policy, level.min_ratio) == ("ratios", 100)
        assert loaded.agent.mode == "enforce"  # the benchmark's own settings stay
        # a drop-in wins over the main file: creation-only's switched-off detection included
        assert loaded.detection.enabled


def test_without_the_option_there_is_no_drop_in(tmp_path: Path) -> None:
    settings, _ = settings_from(parser("").parse_args([]), 23 * 1024, v2=True)
    assert settings.agent_config == ""
    agent = Agent(KubeletNode.__new__(KubeletNode), tmp_path, Path("."))
    config = agent.write_config(tmp_path, tmp_path / "kubeconfig")
    assert drop_ins(config) == []
    assert load_layers(Config, [config]).config.memory == Config().memory


@pytest.mark.parametrize(("text", "error"), [
    ("[memory.levels.shared_cores]\nmin_ratio = 101\n", "memory.levels.shared_cores.min_ratio"),
    ("[memory]\nno_such_key = 1\n", "memory.no_such_key"),
    ("[memory\n", "protect.toml"),
])
def test_a_file_the_agent_would_refuse_stops_the_benchmark(tmp_path: Path, text: str,
                                                            error: str) -> None:
    given = tmp_path / "protect.toml"
    given.write_text(text)
    with pytest.raises(SystemExit, match=f"--agent-config: .*{error}"):
        settings_from(parser("").parse_args(["--agent-config", str(given)]), 23 * 1024,
                      v2=True)
    with pytest.raises(SystemExit, match="--agent-config: cannot read"):
        settings_from(parser("").parse_args(["--agent-config", str(tmp_path / "gone.toml")]),
                      23 * 1024, v2=True)


async def test_the_creation_only_agent_is_settled_by_its_first_memory_guard_cycle(
        tmp_path: Path) -> None:
    """Read from the status socket: on cgroup v2 the guard's first cycle writes nothing."""
    agent = Agent(KubeletNode.__new__(KubeletNode), tmp_path, Path("."), creation_only=True)
    assert not await agent._settled()  # nothing answers yet
    cycles = [0]

    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loops = {"drift": {"cycles": 3}, "memory_guard": {"cycles": cycles[0]}}
        writer.write(json.dumps({"reconciler": {"loops": loops}}).encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(answer, path=str(tmp_path / "status.sock"))
    async with server:
        assert not await agent._settled()
        cycles[0] = 1
        assert await agent._settled()
