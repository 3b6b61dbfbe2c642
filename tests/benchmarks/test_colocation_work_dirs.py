"""``bench/colocation.py --keep DIR``: the directory is checked before any data is written, by
making a work directory as deep as the run's deepest and binding its longest socket in it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.colocation_machine import SOCKETS, check_work_dirs, work_prefix

MODES = ("unmanaged", "agent+noguard", "agent")
REPS = 8
RANDOM_PART = 8
"""The characters ``tempfile.mkdtemp`` adds to a prefix."""


@pytest.fixture
def short() -> Iterator[Path]:
    """A directory with a short path (pytest's own are too deep for a socket below them)."""
    directory = Path(tempfile.mkdtemp(prefix="cw", dir="/tmp"))
    yield directory
    shutil.rmtree(directory)


def socket_path_bytes(under: Path) -> int:
    """How long the longest socket path of a run of MODES x REPS under ``under`` is."""
    deepest = work_prefix("agent+noguard", REPS) + "x" * RANDOM_PART
    return len(str(under / deepest / max(SOCKETS, key=len)))


def test_a_local_directory_passes_is_made_and_is_left_empty(short: Path) -> None:
    under = short / "keep" / "runs"
    check_work_dirs(under, MODES, REPS)
    assert under.is_dir()
    assert list(under.iterdir()) == []


@pytest.mark.parametrize(("length", "passes"), [(107, True), (108, False)])
def test_a_socket_path_of_107_bytes_passes_and_of_108_is_refused(
        short: Path, length: int, passes: bool) -> None:
    under = short / "d"
    under = short / ("d" * (1 + length - socket_path_bytes(under)))
    assert socket_path_bytes(under) == length
    if passes:
        check_work_dirs(under, MODES, REPS)
        assert list(under.iterdir()) == []
        return
    with pytest.raises(ValueError, match=r"cannot hold the run's unix sockets \(AF_UNIX path "
                                         r"too long\); give a shorter directory") as caught:
        check_work_dirs(under, MODES, REPS)
    assert str(caught.value).startswith(f"{under}: ")
    assert list(under.iterdir()) == []


def test_the_deepest_work_directory_is_of_the_longest_mode_and_the_last_repetition(
        short: Path) -> None:
    # The same directory passes with one repetition fewer digits and fails with one more.
    under = short / "d"
    under = short / ("d" * (1 + 107 - socket_path_bytes(under)))
    check_work_dirs(under, ("agent+noguard",), REPS)
    with pytest.raises(ValueError, match="too long"):
        check_work_dirs(under, ("agent+noguard",), 10)
    with pytest.raises(ValueError, match="too long"):
        check_work_dirs(under, ("agent+noguardx", "agent"), REPS)


def test_a_file_in_the_way_is_refused(short: Path) -> None:
    in_the_way = short / "keep"
    in_the_way.write_text("")
    with pytest.raises(ValueError, match=r"cannot hold the run's unix sockets \(File exists\)"):
        check_work_dirs(in_the_way, MODES, REPS)
