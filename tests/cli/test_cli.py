"""The nri-qos command line: subcommands, their arguments and exit codes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import nri_plugin.cli.daemon
import nri_plugin.cli.simulate
from nri_plugin.cli import daemon, main
from nri_plugin.config.loader import parse_toml
from nri_plugin.config.render import render_toml
from nri_plugin.config.schema import Config
from nri_plugin.config.store import ConfigStore
from tests.support.paths import REPO


def test_default_config_prints_the_commented_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["default-config"]) == 0
    out = capsys.readouterr().out
    assert out == render_toml(Config(), commented=True)
    assert out.startswith("# nri-qos node configuration")


def test_check_config_prints_the_effective_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[qos]\ndefault_level = "reclaimed_cores"\n', encoding="utf-8")
    assert main(["check-config", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    effective = parse_toml(Config, captured.out)
    assert effective.qos.default_level == "reclaimed_cores"
    assert effective.plugin == Config().plugin


def test_check_config_reports_errors_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[qos]\ndefault_level = 3\nsurprise = true\n", encoding="utf-8")
    assert main(["check-config", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"{path}: qos.surprise: unknown key (known keys: annotation, default_level, koordinator, "
        "kubernetes_qos, level_namespaces, sources, volcano)",
        f"{path}: qos.default_level: must be a string, got integer",
        f"{path}: invalid configuration (2 errors)",
    ]


def test_check_config_on_a_missing_explicit_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nope.toml"
    assert main(["check-config", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"{path}: cannot read: No such file or directory",
        f"{path}: invalid configuration (1 error)",
    ]


@pytest.mark.parametrize("path", ["/", ""], ids=["root", "empty"])
def test_check_config_on_a_path_that_names_no_file(
    path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # ``--config "$UNSET"``: a path without a file name has no drop-in directory beside it.
    assert main(["check-config", path]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"{path or '.'}: cannot read: Is a directory"
    assert len(err) == 2


async def test_the_daemon_refuses_a_config_path_that_names_no_file(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert await daemon.serve("/", None, None, stop=asyncio.Event(), prelaunched=None) == 2
    (refusal,) = [json.loads(line) for line in capsys.readouterr().err.splitlines()
                  if "config_invalid" in line]
    assert refusal["errors"] == ["/: cannot read: Is a directory"]


def test_run_hands_its_arguments_to_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str | None, ...]] = []

    def fake_run(config: str | None, socket: str | None, level: str | None, *,
                 allow_second_agent: bool, metrics_address: str | None) -> int:
        calls.append((config, socket, level, str(allow_second_agent), metrics_address))
        return 7

    monkeypatch.setattr(nri_plugin.cli.daemon, "main_run", fake_run)
    assert main(["run"]) == 7
    assert main(["run", "--config", "/c.toml", "--nri-socket", "/s.sock", "--log-level",
                 "debug", "--allow-second-agent", "--metrics-address", "10.0.0.7"]) == 7
    # --socket: the older name of --nri-socket.
    assert main(["run", "--socket", "/old.sock"]) == 7
    assert calls == [(None, None, None, "False", None),
                     ("/c.toml", "/s.sock", "debug", "True", "10.0.0.7"),
                     (None, "/old.sock", None, "False", None)]


def test_simulate_hands_its_arguments_to_the_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str | None, ...]] = []

    def fake_simulate(scenario: str | None, config: str | None, level: str | None,
                      runtime: str | None, nri_version: str | None, *, cgroup: str | None,
                      as_json: bool) -> int:
        calls.append((scenario, config, level, runtime, nri_version, cgroup, str(as_json)))
        return 0

    monkeypatch.setattr(nri_plugin.cli.simulate, "main_simulate", fake_simulate)
    assert main(["simulate"]) == 0
    assert main(["simulate", "s.toml", "--config", "c.toml", "--log-level", "warning",
                 "--runtime", "containerd/v1.7.20", "--nri-version", "v0.6.1",
                 "--cgroup", "v1", "--json"]) == 0
    assert calls == [(None, None, None, None, None, None, "False"),
                     ("s.toml", "c.toml", "warning", "containerd/v1.7.20", "v0.6.1", "v1",
                      "True")]


NRI_QOS = str(Path(sys.executable).with_name("nri-qos"))


def simulated_answers(*args: str) -> dict[str, dict[str, object]]:
    """The CreateContainer answers of the bundled scenario, by container, as the installed
    command prints them with --json."""
    done = subprocess.run([NRI_QOS, "simulate", "--json", "--log-level", "error", *args],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    return {a["container"]: a["response"] for a in answers if a["event"] == "create_container"}


def this_hosts_cgroup() -> int:
    done = subprocess.run([NRI_QOS, "probe", "--json"], capture_output=True, text=True,
                          timeout=120, check=True)
    version: int = json.loads(done.stdout)["cgroup"]["version"]
    return version


def test_simulate_previews_this_hosts_cgroup_version_or_the_one_asked_for() -> None:
    v1, v2 = simulated_answers("--cgroup", "v1"), simulated_answers("--cgroup", "v2")
    assert "memory.high" in json.dumps(v2["etl"])
    assert "unified" not in json.dumps(v1["etl"])
    assert simulated_answers() == (v1 if this_hosts_cgroup() == 1 else v2)


def test_simulate_json_is_only_json() -> None:
    done = subprocess.run([NRI_QOS, "simulate", "--json", "--log-level", "error"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert not done.stdout.startswith("#")
    assert all(isinstance(json.loads(line), dict) for line in done.stdout.splitlines())


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--log-level", "loud"])
    assert info.value.code == 2
    assert "invalid choice: 'loud'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    for command in ("run", "simulate", "check-config", "default-config"):
        assert command in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("nri-qos ")


def test_python_dash_m_runs_the_same_command() -> None:
    done = subprocess.run([sys.executable, "-m", "nri_plugin", "check-config", "--help"],
                          capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert done.returncode == 0
    assert "usage: nri-qos check-config" in done.stdout


async def test_a_sighup_while_the_host_is_probed_asks_for_a_reload(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not SIGHUP's default action (the end of the process): a reload request, which the
    configuration watch takes up once the agent runs."""
    config = tmp_path / "config.toml"
    config.write_text("[status]\nenabled = false\n")
    requested: list[bool] = []

    def probe(cfg: Any, audit: Any) -> tuple[None, None]:
        os.kill(os.getpid(), signal.SIGHUP)  # as `systemctl reload` right after the start
        return None, None

    async def run_agent(agent: Any, connection: Any, stop: asyncio.Event) -> int:
        await asyncio.sleep(0.05)  # the loop handles the signal meanwhile
        return 0

    def request_reload(self: ConfigStore) -> None:
        requested.append(True)

    fallen: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: fallen.append(signum))
    monkeypatch.setattr(daemon, "probe", probe)
    monkeypatch.setattr(daemon, "build_agent", lambda *args, **kwargs: None)
    monkeypatch.setattr(daemon, "release_code_pages", lambda modules: 0)
    monkeypatch.setattr(daemon, "run_agent", run_agent)
    monkeypatch.setattr(ConfigStore, "request_reload", request_reload)
    try:
        assert await daemon.serve(str(config), None, "error", stop=asyncio.Event(),
                                  prelaunched=None) == 0
    finally:
        signal.signal(signal.SIGHUP, previous)
    # the process' own handler (a stand-in for the default action here) never ran
    assert fallen == []
    assert requested == [True]
