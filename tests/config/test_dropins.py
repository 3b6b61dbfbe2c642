"""Drop-in configuration: ``<main>.d/*.toml`` applied over the main file in lexical order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.loader import ConfigError
from nri_plugin.config.store import EMBEDDED_DEFAULTS, ConfigStore, load_layered

NRI_QOS = str(Path(sys.executable).with_name("nri-qos"))


def nri_qos(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, as an operator runs it."""
    return subprocess.run([NRI_QOS, *args], capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.fixture
def main(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text('[plugin]\ndeadline_ms = 1000\nstrict = true\n'
                    '[qos]\nsources = ["annotation", "katalyst"]\n')
    (tmp_path / "config.toml.d").mkdir()
    return path


def drop_in(main: Path, name: str, text: str) -> Path:
    path = main.with_name(main.name + ".d") / name
    path.write_text(text)
    return path


def test_drop_ins_apply_in_lexical_order_and_merge_tables_key_by_key(main: Path) -> None:
    drop_in(main, "20-late.toml", '[plugin]\ndeadline_ms = 900\n[agent]\nmode = "enforce"\n')
    drop_in(main, "10-early.toml", '[plugin]\ndeadline_ms = 800\n[qos]\nsources = ["volcano"]\n')
    layered = load_layered(str(main))
    cfg = layered.config
    assert cfg.plugin.deadline_ms == 900  # 20-late after 10-early
    assert cfg.plugin.strict  # the main file's key, untouched by the drop-ins' [plugin]
    assert cfg.qos.sources == ("volcano",)  # an array is replaced, not appended to
    assert cfg.agent.mode == "enforce"
    d = main.with_name("config.toml.d")
    assert layered.files == (str(main), str(d / "10-early.toml"), str(d / "20-late.toml"))
    assert layered.origins[("plugin", "deadline_ms")] == str(d / "20-late.toml")
    assert layered.origins[("plugin", "strict")] == str(main)


def test_only_visible_toml_files_are_read(main: Path) -> None:
    drop_in(main, "10-a.toml.bak", "not toml at all [")
    drop_in(main, ".10-hidden.toml", "not toml at all [")
    drop_in(main, "README", "not toml at all [")
    assert load_layered(str(main)).files == (str(main),)


def test_an_unknown_key_names_its_file_and_key_path(main: Path) -> None:
    bad = drop_in(main, "50-typo.toml", "[numa]\nenabeld = true\n")
    drop_in(main, "60-range.toml", "[plugin]\ndeadline_ms = 5\n")
    with pytest.raises(ConfigError) as info:
        load_layered(str(main))
    range_error, typo = info.value.lines()
    assert typo.startswith(f"{bad}: numa.enabeld: unknown key (known keys: ")
    assert range_error == (f"{main.with_name('config.toml.d') / '60-range.toml'}: "
                           "plugin.deadline_ms: must be 10..60000, got 5")


def test_a_rule_between_two_keys_names_the_file_that_broke_it(main: Path) -> None:
    bad = drop_in(main, "10-l3.toml", "[resctrl.levels.reclaimed_cores]\nl3_start_percent = 100\n")
    with pytest.raises(ConfigError) as info:
        load_layered(str(main))
    assert info.value.lines() == [
        f"{bad}: resctrl.levels.reclaimed_cores.l3_end_percent: must be greater than "
        "l3_start_percent"]


def test_a_toml_error_in_a_drop_in_names_it(main: Path) -> None:
    bad = drop_in(main, "10-broken.toml", "[plugin\n")
    with pytest.raises(ConfigError) as info:
        load_layered(str(main))
    (line,) = info.value.lines()
    assert line.startswith(f"{bad}: invalid TOML: ")


def test_drop_ins_apply_without_the_default_main_file(tmp_path: Path) -> None:
    default = tmp_path / "config.toml"
    assert load_layered(None, default_path=str(default)).files == ()
    (tmp_path / "config.toml.d").mkdir()
    dropped = drop_in(default, "10-enforce.toml", '[agent]\nmode = "enforce"\n')
    layered = load_layered(None, default_path=str(default))
    assert layered.files == (str(dropped),)
    assert layered.config.agent.mode == "enforce"


def test_an_explicit_main_file_must_exist_even_with_drop_ins(tmp_path: Path) -> None:
    main = tmp_path / "config.toml"
    (tmp_path / "config.toml.d").mkdir()
    drop_in(main, "10-enforce.toml", '[agent]\nmode = "enforce"\n')
    with pytest.raises(ConfigError, match="cannot read"):
        load_layered(str(main))


def test_a_new_drop_in_is_noticed_and_reloaded(main: Path) -> None:
    sink = MemoryAuditSink()
    store = ConfigStore(AuditLog(sink))
    store.load_initial(str(main))
    assert store.source == str(main)
    assert not store.changed_on_disk()
    dropped = drop_in(main, "50-enforce.toml", '[agent]\nmode = "enforce"\n')
    assert store.changed_on_disk()
    assert store.reload()
    assert store.current.agent.mode == "enforce"
    assert store.source == f"{main}, {dropped}"
    dropped.unlink()
    assert store.changed_on_disk()
    assert store.reload()
    assert store.current.agent.mode == "observe"


def test_a_bad_drop_in_is_refused_once_and_the_running_config_stays(main: Path) -> None:
    sink = MemoryAuditSink()
    store = ConfigStore(AuditLog(sink))
    running = store.load_initial(str(main))
    bad = drop_in(main, "50-bad.toml", "[agent]\nmode = 1\n")
    assert not store.reload()
    assert store.current is running
    rejected = [fields for name, fields in sink.records if name == "config_rejected"]
    assert len(rejected) == 1
    assert rejected[0]["errors"] == [f"{bad}: agent.mode: must be a string, got integer"]


def test_check_config_says_which_file_set_each_non_default_value(main: Path) -> None:
    d = main.with_name("config.toml.d")
    drop_in(main, "10-canary.toml", '[agent]\nmode = "enforce"\n[plugin]\ndeadline_ms = 1500\n')
    done = nri_qos("check-config", str(main))
    assert done.returncode == 0, done.stderr
    head = done.stdout.split("[agent]", 1)[0]
    # deadline_ms: the drop-in puts the default back, so it is not listed.
    assert head == (
        "# values set by the files, where they differ from the defaults:\n"
        f"#   plugin.strict = true  ({main})\n"
        f'#   qos.sources = ["annotation", "katalyst"]  ({main})\n'
        f'#   agent.mode = "enforce"  ({d / "10-canary.toml"})\n'
    )
    assert 'mode = "enforce"' in done.stdout


def test_check_config_names_the_drop_in_of_an_error(main: Path) -> None:
    bad = drop_in(main, "10-typo.toml", "[numa]\nenabeld = true\n")
    done = nri_qos("check-config", str(main))
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0].startswith(f"{bad}: numa.enabeld: unknown key")
    assert lines[-1] == f"{main}: invalid configuration (1 error)"


def test_the_embedded_defaults_are_named_when_no_file_is_read(tmp_path: Path) -> None:
    layered = load_layered(None, default_path=str(tmp_path / "absent.toml"))
    assert layered.files == ()
    store = ConfigStore(AuditLog(MemoryAuditSink()), default_path=str(tmp_path / "absent.toml"))
    store.load_initial(None)
    assert store.source == EMBEDDED_DEFAULTS


def test_a_drop_in_directory_made_after_start_is_picked_up(tmp_path: Path) -> None:
    # The README's first switch to enforce: no main file, no directory yet.
    default = tmp_path / "config.toml"
    store = ConfigStore(AuditLog(MemoryAuditSink()), default_path=str(default))
    store.load_initial(None)
    assert store.current.agent.mode == "observe"
    (tmp_path / "config.toml.d").mkdir()
    drop_in(default, "90-enforce.toml", '[agent]\nmode = "enforce"\n')
    assert store.changed_on_disk()
    assert store.reload()
    assert store.current.agent.mode == "enforce"
    assert store.in_force.mitigation.taint.dry_run is False
