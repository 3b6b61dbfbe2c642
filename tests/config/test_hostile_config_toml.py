"""Hostile configuration files refused with errors naming the key, everywhere: malformed TOML,
files that are not text files, unknown keys at every depth, wrong types, values out of range.

Each case is played the four ways of :mod:`tests.support.hostile_config`. A file of exactly the
size limit passes: the loader, check-config and a reload accept it (the daemon is not started for
it: that is a whole agent).
"""

from __future__ import annotations

import os

import pytest

from nri_plugin.config.loader import MAX_FILE_BYTES
from tests.support.hostile_config import (
    GOOD,
    Case,
    Expected,
    Starts,
    Tree,
    check_config_names_every_problem,
    daemon_refuses_to_start,
    loader_names_every_problem,
    reload_is_refused,
)

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
    return [Starts("metrcis: unknown key (known keys: agent, cpu_idle, detection, ")]


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


def integer_beyond_a_floats_range_for_a_number(t: Tree) -> Expected:
    # float() of it raised OverflowError: a crash of check-config, of the daemon at start and of
    # the reload watcher (and with it the whole agent).
    t.put(f"[kubernetes]\nrequest_timeout_s = 1{'0' * 400}\n")
    return ["kubernetes.request_timeout_s: must be 0.1..300, got an integer beyond 64 bits"]


def tables_nested_deep_by_dotted_keys(t: Tree) -> Expected:
    # tomllib parses dotted keys without recursing; merging the files' tables recursed once per
    # level, a RecursionError.
    t.put("a" + ".a" * 5000 + " = 1\n")
    return [Starts("a: unknown key (known keys: agent, ")]


def byte_size_negative(t: Tree) -> Expected:
    t.put('[logging]\naudit_max_bytes = "-1Gi"\n')
    return ["logging.audit_max_bytes: not a byte size: '-1Gi' (use e.g. 4Gi, 512Mi, 100M or a "
            "number)"]


def choice_outside_the_list(t: Tree) -> Expected:
    t.put('[qos]\ndefault_level = "../../system_cores"\n')
    return ["qos.default_level: must be one of dedicated_cores, shared_cores, reclaimed_cores, "
            "system_cores, got '../../system_cores'"]


CASES: list[Case] = [
    malformed_unclosed_table, malformed_unterminated_string, malformed_duplicate_key,
    malformed_duplicate_table, malformed_value_then_table, malformed_raw_nul,
    malformed_byte_order_mark, malformed_arrays_nested_deep, malformed_inline_tables_nested_deep,
    not_utf8, binary_garbage, file_too_large, file_at_the_size_limit, file_is_a_directory,
    file_is_a_fifo, unknown_top_level_key, unknown_nested_key, unknown_key_in_an_array_of_tables,
    unknown_key_per_cache, unknown_level, unknown_key_of_a_hundred_kilobytes,
    unknown_key_with_control_characters, wrong_type_string_for_integer,
    wrong_type_float_for_integer, wrong_type_integer_for_boolean, wrong_type_date_for_string,
    wrong_type_table_for_string, wrong_type_value_for_section, wrong_type_in_an_array,
    wrong_type_boolean_for_number, out_of_range_below, out_of_range_largest_64_bit_integer,
    out_of_range_beyond_64_bits, out_of_range_nan, out_of_range_negative_infinity,
    byte_size_of_four_hundred_digits, byte_size_just_over_the_range,
    integer_of_five_thousand_digits, integer_of_twenty_thousand_bits,
    integer_beyond_a_floats_range_for_a_number, tables_nested_deep_by_dotted_keys,
    byte_size_negative, choice_outside_the_list,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_the_loader_names_every_problem(tree: Tree, case: Case) -> None:
    loader_names_every_problem(tree, case)


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_check_config_exits_1_with_one_line_per_error(
        tree: Tree, case: Case, capsys: pytest.CaptureFixture[str]) -> None:
    check_config_names_every_problem(tree, case, capsys)


@pytest.mark.parametrize("case", [c for c in CASES if c is not file_at_the_size_limit],
                         ids=lambda c: c.__name__)
async def test_the_daemon_refuses_to_start(tree: Tree, case: Case,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    await daemon_refuses_to_start(tree, case, capsys)


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_a_reload_is_refused_and_the_running_config_stays(tree: Tree, case: Case) -> None:
    reload_is_refused(tree, case)
