"""Hostile configuration files: every one is refused with errors naming the key, everywhere.

One table of cases (malformed TOML, files that are not text files, unknown keys at every depth,
wrong types, values out of range, and OCI hook executables that anyone but root could replace:
relative, missing, writable by others, owned by another user, behind symbolic links and chains of
them, in directories others can write to). Each case is played four ways, and each must say the
same errors with the same key paths:

* the loader (:func:`load_file`);
* ``nri-qos check-config PATH``: exit status 1, one stderr line per error, nothing on stdout;
* the daemon (:func:`nri_plugin.cli.daemon.serve`): refuses to start, exit status 2, the errors in
  its ``config_invalid`` log line;
* a reload of a running configuration (:class:`ConfigStore`): refused, one ``config_rejected``
  audit record with the errors, the previous configuration still in force.

Cases that must pass (trusted hook paths through links, sticky directories, ``..``, a file of
exactly the size limit) are in the same table with no errors: the loader, check-config and a
reload accept them (the daemon is not started for them: that is a whole agent).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import stat
import typing
from collections import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from hooks.config_fields import meta_of
from hooks.events import Event
from nri_plugin.cli import daemon, main
from nri_plugin.config.hook_paths import MAX_SYMLINKS, check_hook_path
from nri_plugin.config.loader import (
    MAX_ERROR_CHARS,
    MAX_FILE_BYTES,
    ConfigError,
    load_file,
    parse_toml,
)
from nri_plugin.config.schema import Config
from nri_plugin.config.store import ConfigStore
from nri_plugin.sim.simulator import RuntimeSimulator
from protos import nri_api_pb2 as api

OTHER_UID = 1000
HOOK_KEY = "oci_hooks.levels.reclaimed_cores.prestart[0].path"
MONITOR_KEY = "resctrl.monitor_hook.path"
GOOD = "[plugin]\nstrict = true\n"


@dataclass(frozen=True)
class Starts:
    """An expected error known by its beginning (the rest is the TOML parser's wording)."""

    prefix: str


Expected = list[str | Starts]


class Tree:
    """Files under the test's own directory (root's, mode 0700): hooks, directories, links."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = root / "config.toml"

    def put(self, content: str | bytes) -> None:
        """Replace the configuration file with ``content``."""
        if self.config.is_dir():
            self.config.rmdir()
        self.config.unlink(missing_ok=True)
        if isinstance(content, str):
            content = content.encode()
        self.config.write_bytes(content)

    def exe(self, rel: str, *, mode: int = 0o755, uid: int = 0) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\nexit 0\n")
        os.chown(path, uid, uid)
        path.chmod(mode)
        return path

    def dir(self, rel: str, *, mode: int = 0o755, uid: int = 0) -> Path:
        path = self.root / rel
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, uid, uid)
        path.chmod(mode)
        return path

    def link(self, rel: str, target: str | Path, *, uid: int = 0) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)
        os.lchown(path, uid, uid)
        return path

    def hook(self, path: str | Path) -> None:
        self.put(f'[[oci_hooks.levels.reclaimed_cores.prestart]]\npath = "{path}"\n')


def mode_text(mode: int, kind: int = stat.S_IFREG) -> str:
    return stat.filemode(kind | mode)


# --- the table -----------------------------------------------------------------------------------
# Each case writes the configuration file (and whatever it names) and returns the errors expected,
# in the loader's order; an empty list means the file is valid.

def malformed_unclosed_table(t: Tree) -> Expected:
    t.put("[plugin\nname = 1\n")
    return [Starts("invalid TOML: ")]


def malformed_unterminated_string(t: Tree) -> Expected:
    t.put('[plugin]\nname = "nri\n')
    return [Starts("invalid TOML: ")]


def malformed_duplicate_key(t: Tree) -> Expected:
    t.put('[plugin]\nname = "a"\nname = "b"\n')
    return [Starts("invalid TOML: ")]


def malformed_duplicate_table(t: Tree) -> Expected:
    t.put("[plugin]\nstrict = true\n[plugin]\nstrict = false\n")
    return [Starts("invalid TOML: ")]


def malformed_value_then_table(t: Tree) -> Expected:
    t.put("plugin = 1\n[plugin]\nstrict = true\n")
    return [Starts("invalid TOML: ")]


def malformed_raw_nul(t: Tree) -> Expected:
    t.put(b'[plugin]\nname = "a\x00b"\n')
    return [Starts("invalid TOML: ")]


def malformed_byte_order_mark(t: Tree) -> Expected:
    t.put("\ufeff[plugin]\nstrict = true\n")
    return [Starts("invalid TOML: ")]


def malformed_arrays_nested_deep(t: Tree) -> Expected:
    # tomllib recurses per level: without a bound this was a RecursionError, a crash of
    # check-config, of the daemon at start and of the reload watcher.
    t.put("x = " + "[" * 5000 + "]" * 5000 + "\n")
    return ["invalid TOML: arrays or inline tables nested too deep"]


def malformed_inline_tables_nested_deep(t: Tree) -> Expected:
    t.put("x = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n")
    return ["invalid TOML: arrays or inline tables nested too deep"]


def not_utf8(t: Tree) -> Expected:
    t.put(b'[plugin]\nname = "caf\xe9"\n')
    return [Starts("not UTF-8 text: ")]


def binary_garbage(t: Tree) -> Expected:
    t.put(bytes(range(256)) * 4)
    return [Starts("not UTF-8 text: ")]


def file_too_large(t: Tree) -> Expected:
    t.put(b"#" * (MAX_FILE_BYTES + 1))
    return [f"cannot read: larger than {MAX_FILE_BYTES} bytes"]


def file_at_the_size_limit(t: Tree) -> Expected:
    t.put(GOOD.encode() + b"#" * (MAX_FILE_BYTES - len(GOOD)))
    return []


def file_is_a_directory(t: Tree) -> Expected:
    t.put(b"")
    t.config.unlink()
    t.config.mkdir()
    return ["cannot read: Is a directory"]


def file_is_a_fifo(t: Tree) -> Expected:
    # Opened without blocking: a FIFO with no writer must not hang the start or a reload.
    t.put(b"")
    t.config.unlink()
    os.mkfifo(t.config)
    return ["cannot read: not a regular file (a FIFO)"]


def unknown_top_level_key(t: Tree) -> Expected:
    t.put("[metrcis]\nport = 1\n")
    return [Starts("metrcis: unknown key (known keys: agent, detection, ")]


def unknown_nested_key(t: Tree) -> Expected:
    t.put("[memory.levels.reclaimed_cores]\nhigh_ratoi = 1\n")
    return [Starts("memory.levels.reclaimed_cores.high_ratoi: unknown key (known keys: ")]


def unknown_key_in_an_array_of_tables(t: Tree) -> Expected:
    t.put('[[oci_hooks.levels.reclaimed_cores.prestart]]\npath = "/bin/sh"\nshell = true\n')
    return [Starts("oci_hooks.levels.reclaimed_cores.prestart[0].shell: unknown key (known keys: ")]


def unknown_key_per_cache(t: Tree) -> Expected:
    t.put("[resctrl.levels.shared_cores.per_cache.0]\nl3 = 1\n")
    return [Starts("resctrl.levels.shared_cores.per_cache.0.l3: unknown key (known keys: ")]


def unknown_level(t: Tree) -> Expected:
    t.put("[oom.levels.gold_cores]\nscore = 1\n")
    return ["oom.levels.gold_cores: unknown key (allowed: dedicated_cores, shared_cores, "
            "reclaimed_cores, system_cores)"]


def unknown_key_of_a_hundred_kilobytes(t: Tree) -> Expected:
    # The error names the key, bounded: a hostile file cannot flood the terminal or the log.
    t.put(f'["{"k" * 100_000}"]\nx = 1\n')
    return [Starts("kkkk")]


def unknown_key_with_control_characters(t: Tree) -> Expected:
    t.put('["\\u001b[31mred\\r"]\nx = 1\n')
    return [Starts("\\x1b[31mred\\r: unknown key (known keys: ")]


def wrong_type_string_for_integer(t: Tree) -> Expected:
    t.put('[plugin]\ndeadline_ms = "fast"\n')
    return ["plugin.deadline_ms: must be an integer, got string"]


def wrong_type_float_for_integer(t: Tree) -> Expected:
    t.put("[plugin]\ndeadline_ms = 1500.0\n")
    return ["plugin.deadline_ms: must be an integer, got float"]


def wrong_type_integer_for_boolean(t: Tree) -> Expected:
    t.put("[plugin]\nstrict = 1\n")
    return ["plugin.strict: must be a boolean, got integer"]


def wrong_type_date_for_string(t: Tree) -> Expected:
    t.put("[plugin]\nname = 1979-05-27\n")
    return ["plugin.name: must be a string, got date"]


def wrong_type_table_for_string(t: Tree) -> Expected:
    t.put('plugin.name.first = "x"\n')
    return ["plugin.name: must be a string, got table"]


def wrong_type_value_for_section(t: Tree) -> Expected:
    t.put("memory = [1, 2]\n")
    return ["memory: must be a table, got array"]


def wrong_type_in_an_array(t: Tree) -> Expected:
    t.put("[qos]\nsources = [1]\n")
    return ["qos.sources[0]: must be a string, got integer"]


def wrong_type_boolean_for_number(t: Tree) -> Expected:
    t.put("[memory_guard]\nhigh_ratio = true\n")
    return ["memory_guard.high_ratio: must be a number, got boolean"]


def out_of_range_below(t: Tree) -> Expected:
    t.put("[plugin]\ndeadline_ms = 9\n")
    return ["plugin.deadline_ms: must be 10..60000, got 9"]


def out_of_range_largest_64_bit_integer(t: Tree) -> Expected:
    t.put("[oom.levels.shared_cores]\nscore = -9223372036854775808\n")
    return ["oom.levels.shared_cores.score: must be -1000..1000, got -9223372036854775808"]


def out_of_range_beyond_64_bits(t: Tree) -> Expected:
    t.put("[oom.levels.shared_cores]\nscore = 99999999999999999999999999999\n")
    return ["oom.levels.shared_cores.score: must be -1000..1000, got an integer beyond 64 bits"]


def out_of_range_nan(t: Tree) -> Expected:
    t.put("[memory.levels.shared_cores]\nthrottling_factor = nan\n")
    return ["memory.levels.shared_cores.throttling_factor: must be a finite number, got nan"]


def out_of_range_negative_infinity(t: Tree) -> Expected:
    t.put("[memory_guard]\nwatermark_scale_factor = -inf\n")
    return ["memory_guard.watermark_scale_factor: must be a finite number, got -inf"]


def byte_size_of_four_hundred_digits(t: Tree) -> Expected:
    # parse_size went through a float: 400 digits overflowed to infinity and int() raised.
    t.put(f'[logging]\naudit_max_bytes = "{"9" * 400}Gi"\n')
    return [Starts("logging.audit_max_bytes: not a byte size: '9999")]


def byte_size_just_over_the_range(t: Tree) -> Expected:
    t.put('[logging]\naudit_max_bytes = "99999999999999999999Ti"\n')
    return ["logging.audit_max_bytes: must be 4096..1099511627776, got an integer beyond 64 bits"]


def integer_of_five_thousand_digits(t: Tree) -> Expected:
    # tomllib raises a plain ValueError for it (Python's limit on integer strings): a crash.
    t.put(f"[plugin]\ndeadline_ms = {'9' * 5000}\n")
    return [Starts("invalid TOML: Exceeds the limit (4300 digits)")]


def integer_of_twenty_thousand_bits(t: Tree) -> Expected:
    # Hexadecimal has no such limit; printing the value in the error raised instead.
    t.put(f"[plugin]\ndeadline_ms = 0x{'f' * 5000}\n")
    return ["plugin.deadline_ms: must be 10..60000, got an integer beyond 64 bits"]


def byte_size_negative(t: Tree) -> Expected:
    t.put('[logging]\naudit_max_bytes = "-1Gi"\n')
    return ["logging.audit_max_bytes: not a byte size: '-1Gi' (use e.g. 4Gi, 512Mi, 100M or a "
            "number)"]


def choice_outside_the_list(t: Tree) -> Expected:
    t.put('[qos]\ndefault_level = "../../system_cores"\n')
    return ["qos.default_level: must be one of dedicated_cores, shared_cores, reclaimed_cores, "
            "system_cores, got '../../system_cores'"]


def hook_relative(t: Tree) -> Expected:
    t.hook("bin/hook")
    return [f"{HOOK_KEY}: must be an absolute path, got 'bin/hook'"]


def hook_empty(t: Tree) -> Expected:
    t.hook("")
    return [f"{HOOK_KEY}: must be an absolute path, got ''"]


def hook_with_nul(t: Tree) -> Expected:
    # os.stat raised ValueError on an embedded NUL: a crash rather than an error.
    t.hook("/bin/sh\\u0000x")
    return [f"{HOOK_KEY}: must not contain a NUL character, got '/bin/sh\\x00x'"]


def hook_missing(t: Tree) -> Expected:
    t.hook(t.root / "nope")
    return [f"{HOOK_KEY}: {t.root}/nope: No such file or directory"]


def hook_in_a_missing_directory(t: Tree) -> Expected:
    t.hook(t.root / "nodir/hook")
    return [f"{HOOK_KEY}: {t.root}/nodir/hook: {t.root}/nodir: No such file or directory"]


def hook_through_a_file(t: Tree) -> Expected:
    exe = t.exe("hook")
    t.hook(f"{exe}/x")
    return [f"{HOOK_KEY}: {exe}/x: {exe}: not a directory"]


def hook_is_a_directory(t: Tree) -> Expected:
    d = t.dir("hooks")
    t.hook(d)
    return [f"{HOOK_KEY}: {d}: not a regular file"]


def hook_not_executable(t: Tree) -> Expected:
    exe = t.exe("hook", mode=0o644)
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: not executable"]


def hook_owned_by_another_user(t: Tree) -> Expected:
    exe = t.exe("hook", uid=OTHER_UID)
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: must be owned by root (uid 0), owner is uid {OTHER_UID}"]


def hook_group_writable(t: Tree) -> Expected:
    exe = t.exe("hook", mode=0o775)
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: must not be group- or world-writable (mode "
            f"{mode_text(0o775)})"]


def hook_world_writable(t: Tree) -> Expected:
    exe = t.exe("hook", mode=0o757)
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: must not be group- or world-writable (mode "
            f"{mode_text(0o757)})"]


def hook_symlink_to_a_world_writable_file(t: Tree) -> Expected:
    exe = t.exe("real", mode=0o777)
    link = t.link("hook", exe)
    t.hook(link)
    return [f"{HOOK_KEY}: {link} (-> {exe}): must not be group- or world-writable (mode "
            f"{mode_text(0o777)})"]


def hook_symlink_to_a_file_of_another_user(t: Tree) -> Expected:
    exe = t.exe("real", uid=OTHER_UID)
    link = t.link("hook", "real")
    t.hook(link)
    return [f"{HOOK_KEY}: {link} (-> {exe}): must be owned by root (uid 0), owner is uid "
            f"{OTHER_UID}"]


def hook_symlink_owned_by_another_user(t: Tree) -> Expected:
    exe = t.exe("real")
    link = t.link("hook", exe, uid=OTHER_UID)
    t.hook(link)
    return [f"{HOOK_KEY}: {link}: symbolic link {link} must be owned by root (uid 0), owner is "
            f"uid {OTHER_UID}"]


def hook_symlink_chain_to_a_group_writable_file(t: Tree) -> Expected:
    exe = t.exe("deep/real", mode=0o775)
    t.link("b", "deep/real")
    link = t.link("a", t.root / "b")
    t.hook(link)
    return [f"{HOOK_KEY}: {link} (-> {exe}): must not be group- or world-writable (mode "
            f"{mode_text(0o775)})"]


def hook_symlink_chain_through_a_link_of_another_user(t: Tree) -> Expected:
    t.exe("real")
    middle = t.link("b", "real", uid=OTHER_UID)
    link = t.link("a", "b")
    t.hook(link)
    return [f"{HOOK_KEY}: {link}: symbolic link {middle} must be owned by root (uid 0), owner is "
            f"uid {OTHER_UID}"]


def hook_symlink_loop(t: Tree) -> Expected:
    t.link("b", "a")
    link = t.link("a", "b")
    t.hook(link)
    return [f"{HOOK_KEY}: {link}: too many levels of symbolic links"]


def hook_symlink_chain_at_the_kernel_limit(t: Tree) -> Expected:
    exe = t.exe("real")
    previous = "real"
    for i in range(MAX_SYMLINKS):
        previous = t.link(f"l{i}", previous).name
    t.hook(t.root / previous)
    assert check_hook_path(str(exe)) is None
    return []


def hook_symlink_chain_over_the_kernel_limit(t: Tree) -> Expected:
    t.exe("real")
    previous = "real"
    for i in range(MAX_SYMLINKS + 1):
        previous = t.link(f"l{i}", previous).name
    t.hook(t.root / previous)
    return [f"{HOOK_KEY}: {t.root / previous}: too many levels of symbolic links"]


def hook_dangling_symlink(t: Tree) -> Expected:
    link = t.link("hook", "gone")
    t.hook(link)
    return [f"{HOOK_KEY}: {link}: {t.root}/gone: No such file or directory"]


def hook_in_a_world_writable_directory(t: Tree) -> Expected:
    d = t.dir("open", mode=0o777)
    exe = t.exe("open/hook")
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: directory {d} must not be group- or world-writable unless "
            f"sticky (mode {mode_text(0o777, stat.S_IFDIR)})"]


def hook_in_a_group_writable_directory(t: Tree) -> Expected:
    d = t.dir("team", mode=0o775)
    exe = t.exe("team/sub/hook")
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: directory {d} must not be group- or world-writable unless "
            f"sticky (mode {mode_text(0o775, stat.S_IFDIR)})"]


def hook_in_a_directory_of_another_user(t: Tree) -> Expected:
    d = t.dir("home", uid=OTHER_UID)
    exe = t.exe("home/hook")
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: directory {d} must be owned by root (uid 0), owner is uid "
            f"{OTHER_UID}"]


def hook_behind_a_link_into_a_world_writable_directory(t: Tree) -> Expected:
    d = t.dir("open", mode=0o777)
    t.exe("open/hook")
    link = t.link("hook", "open/hook")
    t.hook(link)
    return [f"{HOOK_KEY}: {link}: directory {d} must not be group- or world-writable unless "
            f"sticky (mode {mode_text(0o777, stat.S_IFDIR)})"]


def hook_of_another_user_in_a_sticky_directory(t: Tree) -> Expected:
    t.dir("sticky", mode=0o1777)
    exe = t.exe("sticky/hook", uid=OTHER_UID)
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: must be owned by root (uid 0), owner is uid {OTHER_UID}"]


def hook_of_root_in_a_sticky_directory(t: Tree) -> Expected:
    t.dir("sticky", mode=0o1777)
    t.hook(t.exe("sticky/hook"))
    return []


def hook_trusted_through_links_and_dot_dot(t: Tree) -> Expected:
    t.exe("bin/real")
    t.link("bin/hook", "../bin/./real")
    t.link("alias", "bin")
    t.hook(f"{t.root}/alias/../alias/hook")
    return []


def hook_system_shell(t: Tree) -> Expected:
    # /bin is a link to usr/bin on current distributions: a root-owned link to a root directory.
    t.hook("/bin/sh")
    return []


def monitor_hook_world_writable(t: Tree) -> Expected:
    exe = t.exe("monitor", mode=0o777)
    t.put(f'[resctrl.monitor_hook]\nenabled = true\npath = "{exe}"\n')
    return [f"{MONITOR_KEY}: {exe}: must not be group- or world-writable (mode "
            f"{mode_text(0o777)})"]


def every_problem_at_once(t: Tree) -> Expected:
    exe = t.exe("hook", mode=0o777)
    t.put(f'[plugin]\nstrict = 1\n[qos]\nsurprise = 2\n'
          f'[[oci_hooks.levels.reclaimed_cores.prestart]]\npath = "{exe}"\n')
    return ["plugin.strict: must be a boolean, got integer",
            Starts("qos.surprise: unknown key (known keys: "),
            f"{HOOK_KEY}: {exe}: must not be group- or world-writable (mode "
            f"{mode_text(0o777)})"]


CASES: list[Callable[[Tree], Expected]] = [
    malformed_unclosed_table, malformed_unterminated_string, malformed_duplicate_key,
    malformed_duplicate_table, malformed_value_then_table, malformed_raw_nul,
    malformed_byte_order_mark, malformed_arrays_nested_deep, malformed_inline_tables_nested_deep,
    not_utf8, binary_garbage, file_too_large, file_at_the_size_limit, file_is_a_directory,
    file_is_a_fifo,
    unknown_top_level_key, unknown_nested_key, unknown_key_in_an_array_of_tables,
    unknown_key_per_cache, unknown_level, unknown_key_of_a_hundred_kilobytes,
    unknown_key_with_control_characters,
    wrong_type_string_for_integer, wrong_type_float_for_integer, wrong_type_integer_for_boolean,
    wrong_type_date_for_string, wrong_type_table_for_string, wrong_type_value_for_section,
    wrong_type_in_an_array, wrong_type_boolean_for_number,
    out_of_range_below, out_of_range_largest_64_bit_integer, out_of_range_beyond_64_bits,
    out_of_range_nan,
    out_of_range_negative_infinity, byte_size_of_four_hundred_digits,
    byte_size_just_over_the_range, integer_of_five_thousand_digits,
    integer_of_twenty_thousand_bits, byte_size_negative,
    choice_outside_the_list,
    hook_relative, hook_empty, hook_with_nul, hook_missing, hook_in_a_missing_directory,
    hook_through_a_file, hook_is_a_directory, hook_not_executable, hook_owned_by_another_user,
    hook_group_writable, hook_world_writable, hook_symlink_to_a_world_writable_file,
    hook_symlink_to_a_file_of_another_user, hook_symlink_owned_by_another_user,
    hook_symlink_chain_to_a_group_writable_file,
    hook_symlink_chain_through_a_link_of_another_user, hook_symlink_loop,
    hook_symlink_chain_at_the_kernel_limit, hook_symlink_chain_over_the_kernel_limit,
    hook_dangling_symlink, hook_in_a_world_writable_directory,
    hook_in_a_group_writable_directory, hook_in_a_directory_of_another_user,
    hook_behind_a_link_into_a_world_writable_directory,
    hook_of_another_user_in_a_sticky_directory, hook_of_root_in_a_sticky_directory,
    hook_trusted_through_links_and_dot_dot, hook_system_shell, monitor_hook_world_writable,
    every_problem_at_once,
]


def matches(errors: list[str], expected: Expected) -> bool:
    if len(errors) != len(expected):
        return False
    return all(e.startswith(x.prefix) if isinstance(x, Starts) else e == x
               for e, x in zip(errors, expected, strict=True))


def in_file(path: Path, errors: list[str]) -> list[str]:
    """The errors without the file each one names, which must be ``path``."""
    where = f"{path}: "
    assert all(error.startswith(where) for error in errors), errors
    return [error.removeprefix(where) for error in errors]


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return Tree(tmp_path)


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_the_loader_names_every_problem(tree: Tree, case: Callable[[Tree], Expected]) -> None:
    expected = case(tree)
    if not expected:
        load_file(Config, tree.config)
        return
    with pytest.raises(ConfigError) as info:
        load_file(Config, tree.config)
    errors = list(info.value.errors)
    assert matches(errors, expected), errors
    assert info.value.source == str(tree.config)
    assert all(len(e) <= MAX_ERROR_CHARS + 64 for e in errors)


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_check_config_exits_1_with_one_line_per_error(
        tree: Tree, case: Callable[[Tree], Expected], capsys: pytest.CaptureFixture[str]) -> None:
    expected = case(tree)
    status = main(["check-config", str(tree.config)])
    captured = capsys.readouterr()
    if not expected:
        assert status == 0, captured.err
        assert captured.err == ""
        return
    assert status == 1
    assert captured.out == ""
    lines = captured.err.splitlines()
    where = f"{tree.config}: "
    assert all(line.startswith(where) for line in lines), lines
    assert matches([line.removeprefix(where) for line in lines[:-1]], expected), lines
    n = len(expected)
    assert lines[-1] == f"{where}invalid configuration ({n} error{'s' if n != 1 else ''})"


@pytest.mark.parametrize("case", [c for c in CASES if c not in (
    file_at_the_size_limit, hook_symlink_chain_at_the_kernel_limit,
    hook_of_root_in_a_sticky_directory, hook_trusted_through_links_and_dot_dot,
    hook_system_shell)], ids=lambda c: c.__name__)
async def test_the_daemon_refuses_to_start(tree: Tree, case: Callable[[Tree], Expected],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    expected = case(tree)
    status = await daemon.serve(str(tree.config), None, None, stop=asyncio.Event(),
                                prelaunched=None)
    assert status == 2
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    (refusal,) = [x for x in lines if x.get("event") == "config_invalid"]
    assert refusal["source"] == str(tree.config)
    assert matches(in_file(tree.config, refusal["errors"]), expected), refusal["errors"]
    assert not [x for x in lines if x.get("event") == "config_loaded"]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_a_reload_is_refused_and_the_running_config_stays(
        tree: Tree, case: Callable[[Tree], Expected]) -> None:
    sink = MemoryAuditSink()
    store = ConfigStore(AuditLog(sink), default_path=str(tree.root / "absent.toml"))
    tree.put(GOOD)
    running = store.load_initial(str(tree.config))
    assert running.plugin.strict
    expected = case(tree)
    changed = store.reload()
    name, fields = sink.records[-1]
    if not expected:
        assert name == "config_loaded"
        assert store.current == load_file(Config, tree.config)
        assert changed == (store.current != running)
        return
    assert not changed
    assert store.current is running
    assert name == "config_rejected"
    assert fields["source"] == str(tree.config)
    assert matches(in_file(tree.config, fields["errors"]), expected), fields["errors"]
    assert [n for n, _ in sink.records].count("config_rejected") == 1


# --- every numeric setting at its exact limits ----------------------------------------------------

@dataclass(frozen=True)
class Limit:
    key: str
    integer: bool
    minimum: float | None
    maximum: float | None


def numeric_settings(cls: type[Any] = Config, prefix: str = "") -> Iterator[Limit]:
    """Every int or float setting of the schema with its TOML key path (one level of each
    mapping of tables stands for all)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, meta, key = hints[f.name], meta_of(f), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from numeric_settings(typing.cast(type[Any], tp), key + ".")
            continue
        args = typing.get_args(tp)
        if typing.get_origin(tp) is abc.Mapping and dataclasses.is_dataclass(args[1]):
            names = meta.keys or tuple(getattr(cls(), f.name)) or ("0",)
            yield from numeric_settings(typing.cast(type[Any], args[1]), f"{key}.{names[0]}.")
            continue
        if tp in (int, float):
            yield Limit(key, tp is int, meta.minimum, meta.maximum)


LIMITS = list(numeric_settings())


def toml_for(key: str, value: float, integer: bool) -> str:
    table, _, name = key.rpartition(".")
    literal = str(int(value)) if integer else repr(float(value))
    return f"[{table}]\n{name} = {literal}\n" if table else f"{name} = {literal}\n"


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def range_errors(limit: Limit, text: str) -> list[str]:
    """The errors about the setting's range (another setting's check may name the key too)."""
    assert limit.minimum is not None
    assert limit.maximum is not None
    start = f"{limit.key}: must be {number(limit.minimum)}..{number(limit.maximum)}, got "
    try:
        parse_toml(Config, text)
    except ConfigError as exc:
        return [e for e in exc.errors if e.startswith(start)]
    return []


def test_every_numeric_setting_has_a_range() -> None:
    # An unbounded number would let a typo of a few digits through to the kernel or a timer.
    assert [limit.key for limit in LIMITS if limit.minimum is None or limit.maximum is None] == []
    assert {"plugin.deadline_ms", "memory.levels.dedicated_cores.high_ratio",
            "detection.rss_overuse_factor"} <= {limit.key for limit in LIMITS}


@pytest.mark.parametrize("limit", LIMITS, ids=lambda limit: limit.key)
def test_every_numeric_setting_at_its_exact_limits(limit: Limit) -> None:
    assert limit.minimum is not None
    assert limit.maximum is not None
    step = 1 if limit.integer else max(abs(limit.maximum - limit.minimum) * 1e-6, 1e-9)
    for inside in (limit.minimum, limit.maximum):
        assert range_errors(limit, toml_for(limit.key, inside, limit.integer)) == []
    for outside in (limit.minimum - step, limit.maximum + step):
        assert len(range_errors(limit, toml_for(limit.key, outside, limit.integer))) == 1


# --- a running agent ----------------------------------------------------------------------------

async def test_a_running_agent_refuses_an_untrusted_hook_and_keeps_injecting_the_old_one(
        tree: Tree, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGHUP with a hook path anyone could replace: refused (the key named in the log), and the
    containers created afterwards get the hook of the configuration still in force; a trusted
    path then takes effect, so the refusal is what kept the old one."""
    base = ("[resctrl]\nenabled = false\n[reconciler]\nenabled = false\n"
            "[status]\nenabled = false\n[plugin]\nreconnect_initial_ms = 10\n")
    trusted = tree.exe("bin/trusted")
    replaced = tree.exe("bin/replacement")
    open_dir = tree.dir("open", mode=0o777)
    planted = tree.exe("open/planted")
    hook = '[[oci_hooks.levels.reclaimed_cores.prestart]]\npath = "{}"\n'
    tree.put(base + hook.format(trusted))
    socket_path = tree.root / "nri.sock"
    simulator = RuntimeSimulator(socket_path)
    await simulator.start()
    stop = asyncio.Event()
    lines: list[dict[str, Any]] = []

    async def logged(event: str, count: int = 1) -> dict[str, Any]:
        # Only the log tells: read it as it grows (the whole test runs within a bound).
        while len(found := [x for x in lines if x.get("event") == event]) < count:
            await asyncio.sleep(0.01)
            lines.extend(json.loads(line) for line in capsys.readouterr().err.splitlines()
                         if line.startswith("{"))
        return found[-1]

    async def hook_paths(n: int) -> list[str]:
        pod = api.PodSandbox(id=f"sb-{n}", uid=f"uid-{n}", name=f"p{n}", namespace="ns",
                             annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
        container = api.Container(id=f"c-{n}", pod_sandbox_id=pod.id, name="app")
        answer = await simulator.send(connection, Event.CREATE_CONTAINER, pod, container)
        assert isinstance(answer, api.CreateContainerResponse)
        return [h.path for h in answer.adjust.hooks.prestart]

    try:
        async with asyncio.timeout(30), asyncio.TaskGroup() as group:
            serving = group.create_task(daemon.serve(str(tree.config), str(socket_path), None,
                                                     stop=stop, prelaunched=None))
            connection = await simulator.wait_ready()
            assert await hook_paths(1) == [str(trusted)]

            tree.put(base + hook.format(planted))
            os.kill(os.getpid(), signal.SIGHUP)
            rejected = await logged("config_rejected")
            assert rejected["errors"] == [
                f"{tree.config}: {HOOK_KEY}: {planted}: directory {open_dir} must not be group- or "
                f"world-writable unless sticky (mode {mode_text(0o777, stat.S_IFDIR)})"]
            assert await hook_paths(2) == [str(trusted)]

            tree.put(base + hook.format(replaced))
            os.kill(os.getpid(), signal.SIGHUP)
            assert (await logged("config_loaded", 2))["changed"] is True
            assert await hook_paths(3) == [str(replaced)]
            stop.set()
        assert serving.result() == 0
    finally:
        await simulator.stop()
