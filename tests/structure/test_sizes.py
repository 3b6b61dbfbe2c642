"""Sizes the code keeps: modules a reader takes in at once, classes with one job, and a
``nri_plugin/`` whose top level shows its layers rather than a list of everything.

The limits hold for the whole tree, the tests and benchmarks included; generated protobuf
modules are not written by hand and are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

from tests.support.paths import REPO

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
MAX_TOP_LEVEL_MODULES = 12
TREES = ("nri_plugin", "reconciler", "common", "hooks", "protos", "tests", "bench")


def written_modules() -> Iterator[Path]:
    for tree in TREES:
        for path in sorted((REPO / tree).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield path


def long_modules(paths: Iterable[Path], limit: int, root: Path = REPO) -> list[str]:
    found = []
    for path in paths:
        count = len(path.read_text().splitlines())
        if count > limit:
            found.append(f"{path.relative_to(root)}: {count} lines")
    return found


def long_classes(paths: Iterable[Path], limit: int, root: Path = REPO) -> list[str]:
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                count = node.end_lineno - node.lineno + 1
                if count > limit:
                    found.append(f"{path.relative_to(root)}: class {node.name}, {count} lines")
    return found


def test_no_module_is_over_500_lines() -> None:
    assert long_modules(written_modules(), MAX_MODULE_LINES) == []


def test_no_class_is_over_300_lines() -> None:
    assert long_classes(written_modules(), MAX_CLASS_LINES) == []


def test_nri_plugin_has_at_most_12_modules_at_its_top_level() -> None:
    top = sorted(p.name for p in (REPO / "nri_plugin").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    module = tmp_path / "big.py"
    body = "    x = 1\n" * (MAX_CLASS_LINES - 1)
    module.write_text("class Big:\n" + body)  # exactly at the class limit
    assert long_classes([module], MAX_CLASS_LINES, tmp_path) == []
    module.write_text("class Big:\n" + body + "    y = 2\n")
    assert long_classes([module], MAX_CLASS_LINES, tmp_path) == [
        f"big.py: class Big, {MAX_CLASS_LINES + 1} lines"]
    module.write_text("x = 1\n" * MAX_MODULE_LINES)
    assert long_modules([module], MAX_MODULE_LINES, tmp_path) == []
    module.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules([module], MAX_MODULE_LINES, tmp_path) == [
        f"big.py: {MAX_MODULE_LINES + 1} lines"]
