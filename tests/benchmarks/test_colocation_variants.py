"""``bench/colocation.py --variant NAME=TOML``: a mode ``agent+NAME``, the agent with a file's
settings over the defaults (and over ``--agent-config``), run in the same blocks as the others;
and what ``--keep`` keeps of a repetition's work directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.baselines import MODES, block_order, in_order, modes_for, runs_agent, variant_of
from bench.colocation import output_file, tidy
from bench.colocation_agent import Agent
from bench.colocation_cli import parser, settings_from
from bench.colocation_plan import Repetition, Settings
from bench.colocation_report import as_json, final_line, from_json
from bench.kubelet_node import KubeletNode
from nri_plugin.config.loader import drop_ins, load_layers
from nri_plugin.config.schema import Config

THROTTLE = "[mitigation.tune]\nthrottle_anonymous = true\n"


def settings_of(*argv: str) -> Settings:
    return settings_from(parser("").parse_args(list(argv)), 23 * 1024, v2=True)[0]


def rep(mode: str, latency_ms: float, mib: float) -> Repetition:
    return Repetition(mode=mode, index=1, latencies_ms=[latency_ms] * 100, alone_ms=[],
                      progress=[(0.0, 0.0), (1.0, mib)], indicators={}, actions={}, events=[],
                      adjustments=[], problems=[])


def test_a_variant_is_one_more_agent_mode_after_the_others(tmp_path: Path) -> None:
    (tmp_path / "throttle.toml").write_text(THROTTLE)
    (tmp_path / "quiet.toml").write_text("[detection]\nenabled = false\n")
    settings = settings_of("--modes", "agent,unmanaged", "--variant",
                           f"throttle={tmp_path / 'throttle.toml'}", "--variant",
                           f"quiet={tmp_path / 'quiet.toml'}")
    assert settings.modes == ("unmanaged", "agent", "agent+throttle", "agent+quiet")
    assert settings.variants == {"throttle": THROTTLE,
                                 "quiet": "[detection]\nenabled = false\n"}
    assert [m for m in settings.modes if runs_agent(m)] == [
        "agent", "agent+throttle", "agent+quiet"]
    assert [variant_of(m) for m in settings.modes] == ["", "", "throttle", "quiet"]
    # a mode's name goes into its work directory's path, the agent's kubeconfig's among them
    assert not any(":" in m for m in settings.modes)
    # every block holds every mode once, the variants included
    order = block_order(settings.modes, 3, seed=5)
    for block in range(3):
        assert sorted(m for m, b in order if b == block) == sorted(settings.modes)
    # without the option: the modes as before
    assert settings_of().modes == MODES
    assert settings_of().variants == {}


def test_the_variant_goes_over_the_shared_settings_and_the_benchmarks_own(
        tmp_path: Path) -> None:
    shared = "[mitigation.tune]\nthrottle_anonymous = false\nsqueeze_bytes = \"32Mi\"\n"
    (tmp_path / "shared.toml").write_text(shared)
    (tmp_path / "throttle.toml").write_text(THROTTLE)
    settings = settings_of("--agent-config", str(tmp_path / "shared.toml"),
                           "--variant", f"throttle={tmp_path / 'throttle.toml'}")

    def loaded(variant: str, work: Path) -> Config:
        work.mkdir()
        agent = Agent(KubeletNode.__new__(KubeletNode), work, Path("."),
                      drop_in=settings.agent_config, variant=variant)
        config = agent.write_config(tmp_path, tmp_path / "kubeconfig")
        loaded: Config = load_layers(Config, [config, *drop_ins(config)]).config
        return loaded

    plain = loaded(settings.variants.get(variant_of("agent"), ""), tmp_path / "agent")
    throttled = loaded(settings.variants[variant_of("agent+throttle")], tmp_path / "variant")
    assert not plain.mitigation.tune.throttle_anonymous
    assert throttled.mitigation.tune.throttle_anonymous  # the variant wins over --agent-config
    # what only --agent-config sets reaches the variant; the benchmark's own settings stay
    assert plain.mitigation.tune.squeeze_bytes == throttled.mitigation.tune.squeeze_bytes \
        == 32 << 20
    assert throttled.agent.mode == "enforce"
    assert len(drop_ins(tmp_path / "variant" / "config.toml")) == 2
    assert len(drop_ins(tmp_path / "agent" / "config.toml")) == 1


@pytest.mark.parametrize(("option", "error"), [
    ("Throttle={file}", "variant name 'Throttle'"),
    ("-x={file}", "variant name '-x'"),
    (f"{'a' * 33}={{file}}", "variant name"),
])
def test_a_malformed_name_is_refused(tmp_path: Path, option: str, error: str) -> None:
    (tmp_path / "v.toml").write_text(THROTTLE)
    with pytest.raises(ValueError, match=error):
        settings_of("--variant=" + option.format(file=tmp_path / "v.toml"))
    # the longest name taken
    assert settings_of("--variant", f"{'a' * 32}={tmp_path / 'v.toml'}").modes[-1] == \
        "agent+" + "a" * 32


def test_a_name_twice_is_refused(tmp_path: Path) -> None:
    (tmp_path / "v.toml").write_text(THROTTLE)
    with pytest.raises(ValueError, match="twice"):
        settings_of("--variant", f"t={tmp_path / 'v.toml'}", "--variant",
                    f"t={tmp_path / 'v.toml'}")
    with pytest.raises(ValueError, match="unknown mode"):
        modes_for(["agent+t"], v2=True)  # a variant comes from --variant only


@pytest.mark.parametrize(("text", "error"), [
    ("[mitigation.tune]\nthrottle_anonymous = 3\n", "mitigation.tune.throttle_anonymous"),
    ("[mitigation]\nno_such_key = 1\n", "mitigation.no_such_key"),
])
def test_a_file_the_agent_would_refuse_stops_the_benchmark(tmp_path: Path, text: str,
                                                            error: str) -> None:
    (tmp_path / "v.toml").write_text(text)
    with pytest.raises(SystemExit, match=f"--variant t: .*{error}"):
        settings_of("--variant", f"t={tmp_path / 'v.toml'}")
    with pytest.raises(SystemExit, match="--variant t: cannot read"):
        settings_of("--variant", f"t={tmp_path / 'gone.toml'}")
    for option in ("t", "t="):
        with pytest.raises(SystemExit, match="expected NAME=TOML"):
            settings_of("--variant", option)


def test_the_report_puts_variants_after_the_modes_and_keeps_them_in_json(
        tmp_path: Path) -> None:
    reps = [rep("agent+throttle", 2.0, 300.0), rep("agent", 4.0, 900.0),
            rep("unmanaged", 8.0, 1000.0)]
    assert in_order(r.mode for r in reps) == ["unmanaged", "agent", "agent+throttle"]
    assert final_line(reps) == (
        "online p99 ms: unmanaged=8.00 agent=4.00 agent+throttle=2.00; offline MiB: "
        "unmanaged=1000 agent=900 agent+throttle=300")
    (tmp_path / "v.toml").write_text(THROTTLE)
    settings = settings_of("--variant", f"throttle={tmp_path / 'v.toml'}")
    again, settings_again, _ = from_json(as_json(reps, settings, {"kernel": "k"}))
    assert settings_again.variants == {"throttle": THROTTLE}
    assert settings_again.modes == settings.modes
    assert [r.mode for r in again] == [r.mode for r in reps]
    # a run saved before variants existed still reads
    raw = json.loads(as_json(reps, settings, {"kernel": "k"}))
    del raw["settings"]["variants"]
    assert from_json(json.dumps(raw))[1].variants == {}


def test_a_kept_work_directory_loses_only_the_offline_outputs(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    kept.mkdir()
    for name in ("audit.jsonl", "agent.log", "service.bin", "offline-0.txt", "offline-1.txt"):
        (kept / name).write_text("x")
    for pod in range(2):
        output_file(kept, pod).write_bytes(b"\0" * 4096)
    tidy(kept, keep=True, pods=2)
    assert sorted(p.name for p in kept.iterdir()) == [
        "agent.log", "audit.jsonl", "offline-0.txt", "offline-1.txt", "service.bin"]
    tidy(kept, keep=True, pods=2)  # nothing left to remove: no error
    gone = tmp_path / "gone"
    gone.mkdir()
    output_file(gone, 0).write_bytes(b"\0")
    tidy(gone, keep=False, pods=1)
    assert not gone.exists()
