"""Fixtures of the configuration tests: the tree a hostile configuration case writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hostile_config import Tree


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return Tree(tmp_path)
