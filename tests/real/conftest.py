"""Each test of the real-kernel tier gets a :class:`~tests.support.guest_node.Node` of its own,
on a node without the page cache earlier tests left."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.guest_node import Node, drop_caches


@pytest.fixture(autouse=True)
def clean_memory() -> None:
    """Each test starts on a node without the page cache earlier tests left (their files stay
    until pytest removes old temporary directories): free memory is what the test measures."""
    drop_caches()


@pytest.fixture
def node() -> Iterator[Node]:
    made = Node()
    try:
        yield made
    finally:
        made.close()
