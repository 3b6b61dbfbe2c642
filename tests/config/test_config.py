"""Node configuration: exact error messages, byte sizes, the commented default and round trips."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest

from hooks.config_fields import frozen_map, meta_of
from hooks.memory_qos import MemoryLevel
from hooks.oci_hooks import OciHook, OciLevelHooks
from hooks.resctrl_config import CacheOverride, ResctrlLevel
from hooks.untrusted import bounded
from nri_plugin.config.loader import ConfigError, load_file, parse_size, parse_toml
from nri_plugin.config.render import render_toml
from nri_plugin.config.schema import Config
from nri_plugin.config.store import EMBEDDED_DEFAULTS, load_config
from reconciler.loops.numa_binding import NumaConfig
from tests.support.paths import REPO

# A root-owned executable that is not writable by others: what an OCI hook path must be.
TRUSTED_EXE = os.path.realpath("/bin/sh")


CACHE_ID_PROBLEM = ("cache id must be a decimal number of ASCII digits without leading zeros, "
                    "at most 10 digits")
SYSTEM_CORES_PROBLEM = ("may not be system_cores: only a claim from a namespace in "
                        "qos.level_namespaces.system_cores gets it")


def known_keys(cls: type[Any]) -> str:
    return ", ".join(sorted(f.name for f in dataclasses.fields(cls)))


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_toml(Config, text)
    return list(info.value.errors)


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[memory.levels.reclaimed_cores]\nhigh_ratio = 140",
         "memory.levels.reclaimed_cores.high_ratio: must be 0..100, got 140"),
        ("[plugin]\ndeadline_ms = 5",
         "plugin.deadline_ms: must be 10..60000, got 5"),
        ("[oom.levels.shared_cores]\nscore = -1001",
         "oom.levels.shared_cores.score: must be -1000..1000, got -1001"),
        ("[memory_guard]\nhigh_ratio = 1.5",
         "memory_guard.high_ratio: must be 0.5..1, got 1.5"),
        ("[plugin]\ndeadline_ms = \"fast\"",
         "plugin.deadline_ms: must be an integer, got string"),
        ("[plugin]\nstrict = 1", "plugin.strict: must be a boolean, got integer"),
        ("[plugin]\nname = 7", "plugin.name: must be a string, got integer"),
        ("[kubernetes]\nrequest_timeout_s = \"10\"",
         "kubernetes.request_timeout_s: must be a number, got string"),
        ("plugin = 3", "plugin: must be a table, got integer"),
        ("[qos]\nsources = \"annotation\"", "qos.sources: must be an array, got string"),
        ("[qos]\nsources = [\"annotation\", \"tarot\"]",
         "qos.sources[1]: must be one of annotation, katalyst, koordinator, volcano, "
         "kubernetes_qos, got 'tarot'"),
        ("[qos]\nsources = [\"volcano\", \"volcano\"]",
         "qos.sources: duplicate entries: volcano"),
        ("[qos]\ndefault_level = \"gold\"",
         "qos.default_level: must be one of dedicated_cores, shared_cores, reclaimed_cores, "
         "system_cores, got 'gold'"),
        ("[qos.koordinator]\nBE = \"cheap_cores\"",
         "qos.koordinator: values must be QoS levels (dedicated_cores, shared_cores, "
         "reclaimed_cores, system_cores), got cheap_cores"),
        ("[qos.kubernetes_qos]\nplatinum = \"shared_cores\"",
         "qos.kubernetes_qos.platinum: unknown key (allowed: guaranteed, burstable, besteffort)"),
        ("[memory.levels.gold_cores]\nhigh_ratio = 50",
         "memory.levels.gold_cores: unknown key (allowed: dedicated_cores, shared_cores, "
         "reclaimed_cores, system_cores)"),
        ("[plugin]\nindex = \"7\"", "plugin.index: must be exactly two digits, got '7'"),
        ("[plugin]\nreconnect_initial_ms = 5000\nreconnect_max_ms = 1000",
         "plugin.reconnect_max_ms: must be >= reconnect_initial_ms"),
        ("[numa_balance]\nstep_bytes = \"16Mi\"\nmin_step_bytes = 16777217",
         "numa_balance.min_step_bytes: must be <= step_bytes"),
        ("[logging]\naudit_max_bytes = \"lots\"",
         "logging.audit_max_bytes: not a byte size: 'lots' (use e.g. 4Gi, 512Mi, 100M or a "
         "number)"),
        ("[logging]\naudit_max_bytes = \"1Ki\"",
         "logging.audit_max_bytes: must be 4096..1099511627776, got 1024"),
        ("[resctrl.levels.shared_cores.per_cache.x1]\nmb_percent = 50",
         f"resctrl.levels.shared_cores.per_cache.x1: {CACHE_ID_PROBLEM}"),
        ("[resctrl.levels.reclaimed_cores.per_cache.01]\nmb_percent = 50",
         f"resctrl.levels.reclaimed_cores.per_cache.01: {CACHE_ID_PROBLEM}"),
        ("[qos]\ndefault_level = \"system_cores\"",
         f"qos.default_level: {SYSTEM_CORES_PROBLEM}"),
        ("[qos.kubernetes_qos]\nbesteffort = \"system_cores\"",
         f"qos.kubernetes_qos.besteffort: {SYSTEM_CORES_PROBLEM}"),
        ("[logging]\naudit_max_bytes = \"4096.5\"",
         "logging.audit_max_bytes: not a whole number of bytes: '4096.5' is 4096.5 bytes"),
        ("[memory.levels.shared_cores]\nthrottling_factor = nan",
         "memory.levels.shared_cores.throttling_factor: must be a finite number, got nan"),
        ("[memory_guard]\nwatermark_scale_factor = inf",
         "memory_guard.watermark_scale_factor: must be a finite number, got inf"),
    ],
)
def test_one_error_with_its_key_path(text: str, expected: str) -> None:
    assert errors_of(text) == [expected]


@pytest.mark.parametrize("key", ["01", "00", "\u0661", "\uff11", "12345678901", "9" * 4301,
                                 " 1", "1\n", "+1", "-1", ""])
def test_a_cache_id_has_one_spelling(key: str) -> None:
    # int() reads every one of these (but the last few) as a cache id the pod bounds, which
    # look it up by str(), would never find.
    level = ResctrlLevel(per_cache=frozen_map({key: CacheOverride(mb_percent=10)}))
    ((path, problem),) = level.validate()
    assert problem == CACHE_ID_PROBLEM
    assert path == f"per_cache.{bounded(key, 32)}"


@pytest.mark.parametrize("key", ["0", "1", "10", "4294967295", "9999999999"])
def test_canonical_cache_ids_are_taken(key: str) -> None:
    assert ResctrlLevel(per_cache=frozen_map({key: CacheOverride()})).validate() == []


def test_a_cache_id_of_thousands_of_digits_is_named_and_refused_in_one_line() -> None:
    key = "9" * 4301
    assert errors_of(f"[resctrl.levels.reclaimed_cores.per_cache.{key}]\nmb_percent = 50") == [
        f"resctrl.levels.reclaimed_cores.per_cache.{bounded(key, 32)}: {CACHE_ID_PROBLEM}"]


@pytest.mark.parametrize("level", ["dedicated_cores", "shared_cores", "reclaimed_cores"])
def test_every_level_but_system_cores_may_be_a_default_or_a_class_level(level: str) -> None:
    cfg = parse_toml(Config, f'[qos]\ndefault_level = "{level}"\n'
                             f'[qos.kubernetes_qos]\nbesteffort = "{level}"\n')
    assert (cfg.qos.default_level, cfg.qos.kubernetes_qos["besteffort"]) == (level, level)


def test_unknown_keys_name_the_full_path_and_the_known_keys() -> None:
    assert errors_of("[numa]\nenabeld = true") == [
        f"numa.enabeld: unknown key (known keys: {known_keys(NumaConfig)})"
    ]
    top = errors_of("[metrcis]\nport = 1")
    assert len(top) == 1
    assert top[0].startswith("metrcis: unknown key (known keys: agent, cpu_idle, detection, ")
    nested = errors_of("[resctrl.monitor_hook]\ntimeout = 3")
    assert nested[0].startswith("resctrl.monitor_hook.timeout: unknown key (known keys: ")


def test_every_problem_of_a_file_is_reported_at_once() -> None:
    text = """
[plugin]
deadline_ms = "x"
[memory.levels.reclaimed_cores]
high_ratio = 140
bogus = 1
"""
    assert sorted(errors_of(text)) == sorted([
        "plugin.deadline_ms: must be an integer, got string",
        f"memory.levels.reclaimed_cores.bogus: unknown key (known keys: "
        f"{known_keys(MemoryLevel)})",
        "memory.levels.reclaimed_cores.high_ratio: must be 0..100, got 140",
    ])


def test_bad_toml_syntax() -> None:
    with pytest.raises(ConfigError) as info:
        parse_toml(Config, "[plugin\nname = 1", "node.toml")
    assert info.value.source == "node.toml"
    (error,) = info.value.errors
    assert error.startswith("invalid TOML: ")
    assert "line 1" in error
    assert str(info.value).startswith("node.toml: invalid TOML: ")


def test_duplicate_key_is_a_syntax_error() -> None:
    (error,) = errors_of("[plugin]\nname = \"a\"\nname = \"b\"")
    assert error.startswith("invalid TOML: ")


def test_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_file(Config, tmp_path / "absent.toml")
    assert info.value.errors == ("cannot read: No such file or directory",)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'[plugin]\nname = "caf\xe9"\n')
    with pytest.raises(ConfigError) as info:
        load_file(Config, latin)
    assert info.value.errors[0].startswith("not UTF-8 text: ")


# --- values -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096), ("4Ki", 4096), ("4KiB", 4096), ("4k", 4000), ("512Mi", 512 << 20),
        ("512MiB", 512 << 20), ("100M", 100_000_000), ("4Gi", 4 << 30), ("1.5Gi", 3 << 29),
        ("2Ti", 2 << 40), (" 7 B ", 7),
        # exact, where a float would round: 2**64 + 1
        ("18446744073709551617", (1 << 64) + 1),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", [
    "", "Gi", "-1Gi", "4 Gigs", "1e9", "0x10",
    # other scripts' digits and spaces, and the Kelvin sign for K
    "\u0661Gi", "\uff11\uff12", "4\u00a0Gi", "1\u212a",
])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a byte size"):
        parse_size(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("0.0009765625Ki", 1), ("0.0009765624Ki", None), ("0.0001Ki", None), ("0.5", None),
    ("1.5", None), ("1.5Ki", 1536), ("0.001K", 1), ("0.0015K", None), ("4096.0", 4096),
])
def test_a_size_is_a_whole_number_of_bytes(text: str, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match=f"not a whole number of bytes: '{text}' is "):
            parse_size(text)
    else:
        assert parse_size(text) == expected


def test_byte_sizes_as_strings_or_integers() -> None:
    cfg = parse_toml(Config, '[memory_guard]\nwatermark_floor_bytes = "2Gi"\n'
                             "max_step_bytes = 268435456\n")
    assert cfg.memory_guard.watermark_floor_bytes == 2 << 30
    assert cfg.memory_guard.max_step_bytes == 256 << 20


def test_partial_tables_keep_the_other_defaults() -> None:
    cfg = parse_toml(Config, "[memory.levels.reclaimed_cores]\nhigh_ratio = 80\n"
                             "[qos.koordinator]\nBE = \"shared_cores\"\n")
    reclaimed = cfg.memory.levels["reclaimed_cores"]
    assert reclaimed.high_ratio == 80
    assert reclaimed.policy == "ratios"  # the level's own default, not the class default
    assert cfg.memory.levels["shared_cores"] == Config().memory.levels["shared_cores"]
    assert cfg.qos.koordinator["BE"] == "shared_cores"
    assert cfg.qos.koordinator["LSE"] == "dedicated_cores"


def test_collection_checks_apply_to_the_whole_not_each_item() -> None:
    cfg = parse_toml(Config, '[qos]\nsources = ["annotation", "kubernetes_qos"]\n')
    assert cfg.qos.sources == ("annotation", "kubernetes_qos")


def test_empty_document_is_the_default() -> None:
    assert parse_toml(Config, "") == Config()


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.plugin.strict = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.qos.koordinator["XX"] = "shared_cores"  # type: ignore[index]


# --- rendering ----------------------------------------------------------------------------------

def missing_keys(obj: Any, data: dict[str, Any], prefix: str = "") -> list[str]:
    """Settings of ``obj`` absent from the parsed TOML ``data`` (empty collections of tables,
    shown as commented examples, excepted)."""
    missing: list[str] = []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, path = getattr(obj, f.name), f"{prefix}{f.name}"
        item = (typing.get_args(hints[f.name]) or (None,))[-1]
        tables = dataclasses.is_dataclass(item) and isinstance(value, tuple | typing.Mapping)
        if f.name not in data:
            if not (tables and not value):
                missing.append(path)
            continue
        if dataclasses.is_dataclass(value):
            missing += missing_keys(value, data[f.name], path + ".")
        elif tables and isinstance(value, typing.Mapping):
            for key, sub in value.items():
                missing += missing_keys(sub, data[f.name][key], f"{path}.{key}.")
    return missing


def test_deploy_config_is_the_rendered_default() -> None:
    deployed = (REPO / "deploy" / "config.toml").read_text(encoding="utf-8")
    assert deployed == render_toml(Config(), commented=True), (
        "deploy/config.toml is stale: regenerate it with "
        "`python -m nri_plugin default-config > deploy/config.toml`"
    )


def test_commented_default_parses_back_to_the_default() -> None:
    assert parse_toml(Config, render_toml(Config(), commented=True)) == Config()


def test_commented_default_has_every_key_with_a_comment() -> None:
    text = render_toml(Config(), commented=True)
    assert missing_keys(Config(), tomllib.loads(text)) == []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if " = " in line and not line.startswith("#") and not line.startswith("["):
            in_plain_mapping = lines[i - 1].startswith("[") or " = " in lines[i - 1]
            assert lines[i - 1].startswith("#") or in_plain_mapping, line
    assert all(len(line) <= 100 for line in lines)


def test_comment_shows_doc_unit_range_and_default() -> None:
    text = render_toml(Config(), commented=True)
    assert ("# Rotate the audit file when it reaches this size. (bytes; 4Ki..1Ti; default "
            '"16Mi")\naudit_max_bytes = "16Mi"\n') in text
    assert ("# Log level of the operational log. (one of debug, info, warning, error; default "
            '"info")\nlevel = "info"\n') in text
    assert "[memory.levels.reclaimed_cores]\n" in text


def test_empty_collections_of_tables_appear_as_commented_examples() -> None:
    text = render_toml(Config(), commented=True)
    assert "# [[oci_hooks.levels.dedicated_cores.prestart]]\n# # Absolute path" in text
    assert "# [resctrl.levels.reclaimed_cores.per_cache.0]\n" in text
    # Uncommenting an example gives a table the loader accepts once its values are filled in.
    lines = text.splitlines()
    start = lines.index("# [resctrl.levels.reclaimed_cores.per_cache.0]")
    example = "\n".join(line[2:] for line in lines[start:start + 7])
    assert example.count(" = ") == 3
    parsed = parse_toml(Config, example)
    assert parsed.resctrl.levels["reclaimed_cores"].per_cache == {"0": CacheOverride()}


def custom_config() -> Config:
    base = Config()
    hook = OciHook(path=TRUSTED_EXE, args=(TRUSTED_EXE, "-c", 'echo "quoted\\path"\t'),
                   env=("A=1", "B=ü"), timeout_s=3)
    level = dataclasses.replace(
        base.resctrl.levels["reclaimed_cores"],
        per_cache=frozen_map({"0": CacheOverride(l3_end_percent=40), "1": CacheOverride()}),
    )
    return dataclasses.replace(
        base,
        plugin=dataclasses.replace(base.plugin, name="nri-qos.test", strict=True),
        qos=dataclasses.replace(base.qos, sources=("volcano", "annotation"),
                                annotation="example.com/qos level",
                                volcano=frozen_map({**base.qos.volcano, "x.y": "system_cores"})),
        resctrl=dataclasses.replace(
            base.resctrl, levels=frozen_map({**base.resctrl.levels, "reclaimed_cores": level})
        ),
        oci_hooks=dataclasses.replace(base.oci_hooks, levels=frozen_map({
            "reclaimed_cores": OciLevelHooks(prestart=(hook, OciHook(path=TRUSTED_EXE)),
                                             poststop=(hook,)),
        })),
        memory_guard=dataclasses.replace(base.memory_guard, watermark_floor_bytes=12345,
                                         high_ratio=0.5),
        logging=dataclasses.replace(base.logging, audit_max_bytes=3 << 30),
    )


@pytest.mark.parametrize("commented", [False, True])
def test_effective_config_round_trips(commented: bool) -> None:
    cfg = custom_config()
    text = render_toml(cfg, commented=commented)
    assert parse_toml(Config, text) == cfg
    if not commented:
        assert "#" not in text.replace('"#', "")
        assert "[[oci_hooks.levels.reclaimed_cores.prestart]]" in text
        assert '"x.y" = "system_cores"' in text


def test_effective_default_round_trips() -> None:
    assert parse_toml(Config, render_toml(Config(), commented=False)) == Config()


def test_every_setting_is_documented() -> None:
    def walk(cls: type[Any]) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert meta_of(f).doc.strip(), f"{cls.__name__}.{f.name} has no doc"
            for tp in (hints[f.name], *typing.get_args(hints[f.name])):
                if dataclasses.is_dataclass(tp):
                    walk(typing.cast(type[Any], tp))

    walk(Config)


# --- the command line ---------------------------------------------------------------------------

def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nri_plugin", *args], capture_output=True,
                          text=True, cwd=cwd or REPO, timeout=120, check=False)


def test_default_config_round_trips_through_check_config(tmp_path: Path) -> None:
    printed = run_cli("default-config")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == render_toml(Config(), commented=True)
    path = tmp_path / "config.toml"
    path.write_text(printed.stdout, encoding="utf-8")
    checked = run_cli("check-config", str(path))
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr == ""
    assert parse_toml(Config, checked.stdout) == Config()
    assert checked.stdout == render_toml(Config(), commented=False)


def test_check_config_prints_every_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[memory.levels.reclaimed_cores]\nhigh_ratio = 140\n[plugin]\nstrict = 1\n",
                    encoding="utf-8")
    checked = run_cli("check-config", str(path))
    assert checked.returncode == 1
    assert checked.stdout == ""
    assert checked.stderr.splitlines() == [
        f"{path}: plugin.strict: must be a boolean, got integer",
        f"{path}: memory.levels.reclaimed_cores.high_ratio: must be 0..100, got 140",
        f"{path}: invalid configuration (2 errors)",
    ]


def test_load_config_default_path_semantics(tmp_path: Path) -> None:
    absent = str(tmp_path / "absent.toml")
    assert load_config(None, default_path=absent) == (Config(), EMBEDDED_DEFAULTS)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(absent)
    present = tmp_path / "present.toml"
    present.write_text("[plugin]\nstrict = true\n", encoding="utf-8")
    cfg, source = load_config(None, default_path=str(present))
    assert cfg.plugin.strict
    assert source == str(present)
