"""Every file of the tree the README and the docs name (``deploy/...``, ``reconciler/...``,
``tests/...::test_name``) exists, and so does every test they name; every kustomize component and
overlay deploy/ ships is named in the README."""

from __future__ import annotations

import re
from collections.abc import Iterator

from tests.support.paths import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = "deploy|docs|tests|reconciler|nri_plugin|common|hooks|bench|protos"
GONE = {"bench/zoneinfo.py": "named as the module that shadowed the standard library's"}
"""Files the docs name on purpose although they are no longer there, and why."""


def references() -> Iterator[tuple[str, str, str]]:
    """(document, path, test or "") of every path of the tree in a code span."""
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for named, test in re.findall(rf"`((?:{TOP})/[A-Za-z0-9_./-]+?)\.?(?:::([A-Za-z0-9_]+))?`",
                                      text):
            yield path.name, named, test


def test_the_walk_finds_references() -> None:
    found = {(named, test) for _, named, test in references()}
    assert ("deploy/config.toml", "") in found
    assert any(test for _, test in found)


def test_every_named_file_and_test_exists() -> None:
    problems = []
    for doc, named, test in references():
        target = REPO / named
        if named in GONE:
            continue
        if not target.exists():
            problems.append(f"{doc}: {named} does not exist")
        elif test and not re.search(rf"^(async )?def {test}\b", target.read_text(
                encoding="utf-8"), re.M):
            problems.append(f"{doc}: {named} has no {test}")
    assert problems == []


def test_every_component_and_overlay_is_named_in_the_readme() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    kustomize = REPO / "deploy" / "kustomize"
    shipped = [f"{kind.name}/{d.name}" for kind in (kustomize / "components",
                                                     kustomize / "overlays")
               for d in sorted(kind.iterdir()) if d.is_dir()]
    assert "components/enforce" in shipped
    assert [name for name in shipped if f"`{name}`" not in readme] == []
