"""The layout of the tests themselves: folders that are packages, helpers in ``tests/support``,
and test modules that share through those rather than through each other.

A test module imported by another runs its module-level code twice under two names and ties the
two together; what both need belongs in ``tests/support`` (plain code) or a ``conftest.py``
(fixtures). The same goes for ``bench/``, which reuses the tests' fakes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.support.paths import REPO

TESTS = REPO / "tests"
# The real-kernel tier's harness is a program of its own (``python -m tests.vm``).
HELPER_PACKAGES = (TESTS / "support", TESTS / "vm")


def python_files(*tops: Path) -> Iterator[Path]:
    for top in tops:
        yield from sorted(top.rglob("*.py"))


def imported_modules(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            # ``from tests.e2e import test_x`` names the module in the imported names.
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


def is_test_module(name: str) -> bool:
    """A test module or a conftest of ours, by its dotted name."""
    parts = name.split(".")
    return parts[0] == "tests" and (parts[-1].startswith("test_") or parts[-1] == "conftest")


def imports_of_test_modules(tree: ast.Module) -> list[tuple[int, str]]:
    return [(line, name) for line, name in imported_modules(tree) if is_test_module(name)]


def test_no_module_imports_a_test_module_or_a_conftest() -> None:
    found = [f"{path.relative_to(REPO)}:{line}: {name}"
             for path in python_files(TESTS, REPO / "bench")
             for line, name in imports_of_test_modules(ast.parse(path.read_text(), str(path)))]
    assert found == []


def test_every_folder_of_tests_is_a_package() -> None:
    folders = {path.parent for path in python_files(TESTS)}
    assert sorted(str(f.relative_to(REPO)) for f in folders
                  if not (f / "__init__.py").is_file()) == []


def test_helpers_live_in_the_support_package() -> None:
    misplaced = [str(path.relative_to(REPO)) for path in python_files(TESTS)
                 if not path.name.startswith("test_")
                 and path.name not in ("conftest.py", "__init__.py")
                 and not any(path.is_relative_to(p) for p in HELPER_PACKAGES)]
    assert misplaced == []


def test_the_import_check_sees_what_it_looks_for() -> None:
    tree = ast.parse("import tests.e2e.test_simulator\n"
                     "from tests.deploy.test_deploy import built\n"
                     "from tests.e2e import test_capture_replay\n"
                     "from tests.real.conftest import Node\n"
                     "from tests.support.manifests import built\n"
                     "from bench.baselines import MODES\n")
    assert [line for line, _ in imports_of_test_modules(tree)] == [1, 2, 3, 4]
