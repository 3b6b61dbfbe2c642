"""The manifests of ``deploy/`` as the tests read them: the kustomize base as written, a
kustomize build, and the check that every object parses into the Kubernetes client's models."""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import ApiClient

from tests.support.paths import REPO

DEPLOY = REPO / "deploy"
BASE = DEPLOY / "kustomize" / "base"
CANARY = DEPLOY / "kustomize" / "overlays" / "canary"
COMPONENTS = DEPLOY / "kustomize" / "components"
WRAPPER = DEPLOY / "preinstalled" / "10-nri-qos"

Doc = dict[str, Any]


def yaml_docs(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def one(docs: list[Doc], kind: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def base_docs() -> list[Doc]:
    """The base's resources as written, and the ConfigMap its generator makes (unhashed)."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = [d for name in kustomization["resources"] for d in yaml_docs((BASE / name).read_text())]
    (generator,) = kustomization["configMapGenerator"]
    data = {name: (BASE / name).read_text() for name in generator["files"]}
    docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": generator["name"], "namespace": kustomization["namespace"]},
                 "data": data})
    return docs


@cache
def kustomize() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        probe = subprocess.run(["kubectl", "kustomize", "--help"], capture_output=True,
                               check=False)
        if probe.returncode == 0:
            return ["kubectl", "kustomize"]
    return None


def built(directory: Path) -> list[Doc]:
    """What ``kustomize build`` makes of ``directory``; the calling test skips without it."""
    command = kustomize()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    result = subprocess.run([*command, str(directory)], capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    return yaml_docs(result.stdout)


def container_of(daemonset: Doc) -> Doc:
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    return dict(container)


def assert_parses_into_models(docs: list[Doc]) -> None:
    """Each object becomes its client model (required fields, types), and back to the same
    object: a field the model does not know (a misspelling) would be lost on the way."""
    with ApiClient() as client:
        for doc in docs:
            model = client.deserialize(json.dumps(doc), f"V1{doc['kind']}", "application/json")
            assert client.sanitize_for_serialization(model) == json.loads(json.dumps(doc)), (
                f"{doc['kind']} {doc['metadata']['name']}: fields the model does not know")
