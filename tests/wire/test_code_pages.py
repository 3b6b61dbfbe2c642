"""The page cache of loaded code goes back: the files named, and, on this machine's kernel, the
pages a memory cgroup was charged for them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import cast

import pytest

from nri_plugin.code_pages import code_files, release_code_pages
from tests.support.paths import REPO
from tests.support.realroot import cache_drops, in_cgroup, memory_hierarchy, unavailable_any

MIB = 1 << 20


def module(**files: object) -> ModuleType:
    return cast(ModuleType, SimpleNamespace(**files))


def test_a_module_names_its_source_and_its_compiled_file(tmp_path: Path) -> None:
    source, compiled = tmp_path / "m.py", tmp_path / "m.pyc"
    found = code_files([module(__file__=str(source), __cached__=str(compiled)),
                        module(__file__=None), module(), module(__file__=str(source))])
    assert found == {str(source), str(compiled)}


def test_files_gone_since_they_were_loaded_are_passed_over(tmp_path: Path) -> None:
    kept = tmp_path / "kept.py"
    kept.write_text("x = 1\n")
    modules = [module(__file__=str(kept), __cached__=str(tmp_path / "gone.pyc"))]
    assert release_code_pages(modules) == 1
    assert release_code_pages([]) == 0


CHILD = """
import sys
from types import SimpleNamespace
from nri_plugin.code_pages import release_code_pages

cgroup, path = sys.argv[1], sys.argv[2]
def cached():
    stat = dict(line.split() for line in open(cgroup + "/memory.stat"))
    return int(stat["cache"] if "cache" in stat else stat["file"])
with open(path, "rb") as f:
    while f.read(1 << 20):
        pass
loaded = cached()
assert release_code_pages([SimpleNamespace(__file__=path)]) == 1
print(loaded, cached())
"""


@pytest.mark.skipif(bool(unavailable_any()), reason=unavailable_any() or "-")
def test_the_pages_a_cgroup_was_charged_for_a_loaded_file_go_back(tmp_path: Path) -> None:
    data = tmp_path / "code.bin"
    with open(data, "wb") as f:
        f.write(os.urandom(32 * MIB))
        f.flush()
        os.fsync(f.fileno())
    cgroup = memory_hierarchy() / f"nri-qos-code-pages-{os.getpid()}"
    cgroup.mkdir()
    try:
        for _ in range(3):  # again only if the machine's page cache was dropped meanwhile
            drops = cache_drops()
            with open(data, "rb") as f:  # not cached before the child
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            done = subprocess.run(in_cgroup(cgroup, [sys.executable, "-c", CHILD, str(cgroup),
                                                     str(data)]),
                                  cwd=REPO, check=True, capture_output=True, text=True,
                                  timeout=60)
            loaded, after = (int(v) for v in done.stdout.split())
            if cache_drops() == drops:
                break
        assert loaded >= 32 * MIB  # the child's read was charged to its cgroup
        assert after <= loaded - 30 * MIB
    finally:
        cgroup.rmdir()
