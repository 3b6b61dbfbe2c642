"""Locations shared by the tests, and the reference decoder that lives with the recordings."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
# Kernel files kept as the tests read them (see its README).
KERNEL_FIXTURES = REPO / "tests" / "fixtures" / "kernel"
# The recordings of a real containerd live beside the repository; NRI_CAPTURES_DIR overrides.
CAPTURES = Path(os.environ.get("NRI_CAPTURES_DIR", REPO.parent / "shared" / "nri-captures"))
RECORDINGS = sorted(CAPTURES.glob("*.jsonl"))


def load_reference_decoder() -> ModuleType:
    """``capdump.py`` from beside the recordings: an independent decoder to check ours against."""
    spec = importlib.util.spec_from_file_location("capdump", CAPTURES / "capdump.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
