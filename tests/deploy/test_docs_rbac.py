"""The permissions docs/kubernetes.md and the README say the ClusterRole grants are the rules of
deploy/kustomize/base/rbac.yaml (tests/deploy/test_rbac.py holds those to what the code calls)."""

from __future__ import annotations

import re

from tests.support.manifests import BASE, one, yaml_docs
from tests.support.paths import REPO

Permission = tuple[str, str, str]  # (API group, resource[/subresource], verb)


def granted() -> set[Permission]:
    role = one(yaml_docs((BASE / "rbac.yaml").read_text(encoding="utf-8")), "ClusterRole")
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def documented_table() -> set[Permission]:
    """The rows of the RBAC table of docs/kubernetes.md."""
    text = (REPO / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    found: set[Permission] = set()
    for group, resource, verbs in re.findall(
            r"^\| (core|[a-z.]+) \| `([a-z/]+)` \| ((?:`[a-z]+`(?:, )?)+) \|", text, re.M):
        for verb in re.findall(r"`([a-z]+)`", verbs):
            found.add(("" if group == "core" else group, resource, verb))
    return found


def documented_summary() -> set[Permission]:
    """The README's list: ``(pods get/list/watch, pods/eviction create, ...)``."""
    text = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    listed = re.search(r"ClusterRole granting exactly what the code calls \(([^)]*)\)", text)
    assert listed is not None
    found: set[Permission] = set()
    for item in listed.group(1).split(", "):
        resource, verbs = item.split(" ")
        group = "apps" if resource in ("daemonsets", "deployments") else ""
        found |= {(group, resource, verb) for verb in verbs.split("/")}
    return found


def test_the_walks_find_the_rules() -> None:
    assert ("", "pods/eviction", "create") in granted()
    assert ("apps", "daemonsets", "get") in documented_table()
    assert ("", "pods", "watch") in documented_summary()


def test_the_kubernetes_doc_lists_exactly_the_roles_rules() -> None:
    assert documented_table() == granted()


def test_the_readme_lists_exactly_the_roles_rules() -> None:
    assert documented_summary() == granted()
