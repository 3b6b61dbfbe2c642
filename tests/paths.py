"""Locations shared by the tests."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The recordings of a real containerd live beside the repository.
CAPTURES = REPO.parent / "shared" / "nri-captures"
