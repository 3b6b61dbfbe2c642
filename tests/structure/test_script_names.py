"""Scripts run as ``python bench/<name>.py`` put ``bench/`` first on ``sys.path``: a module
there named like one of the standard library's takes its place for every import in the process
(``bench/zoneinfo.py`` broke the kubernetes client's import of ``zoneinfo`` that way)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support.paths import REPO

SCRIPT_DIRS = ("bench",)


def shadowing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.py")
                  if p.stem in sys.stdlib_module_names)


def test_no_script_directory_shadows_the_standard_library() -> None:
    for name in SCRIPT_DIRS:
        assert shadowing(REPO / name) == [], name


def test_a_module_named_like_the_standard_librarys_is_found(tmp_path: Path) -> None:
    (tmp_path / "zoneinfo.py").write_text("")
    (tmp_path / "zoneinfo_parse.py").write_text("")
    assert shadowing(tmp_path) == ["zoneinfo.py"]
