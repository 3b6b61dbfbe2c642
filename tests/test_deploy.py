"""The deployment files parse, mount what the shipped configuration points at, and grant what the
Kubernetes client uses."""

from __future__ import annotations

import configparser
import re
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from nri_plugin.config.loader import parse_toml
from nri_plugin.config.schema import Config
from reconciler import k8s
from tests.paths import REPO

DEPLOY = REPO / "deploy"

# Every CoreV1Api method k8s.py calls -> the (API group, resource, verb) permissions it needs.
API_CALLS = {
    "list_pod_for_all_namespaces": {("", "pods", "list"), ("", "pods", "watch")},
    "create_namespaced_pod_eviction": {("", "pods/eviction", "create")},
    "read_node": {("", "nodes", "get")},
    "patch_node": {("", "nodes", "patch")},
    "patch_node_status": {("", "nodes/status", "patch")},
}


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


@pytest.fixture(scope="module")
def daemonset() -> dict[str, Any]:
    return _one(_docs("daemonset.yaml"), "DaemonSet")


@pytest.fixture(scope="module")
def shipped_config() -> Config:
    configmap = _one(_docs("daemonset.yaml"), "ConfigMap")
    config: Config = parse_toml(Config, configmap["data"]["config.toml"])
    return config


def _container(daemonset: dict[str, Any]) -> dict[str, Any]:
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _host_path_of(daemonset: dict[str, Any], container_path: str) -> str | None:
    """The host path a container path lands on, through the pod's hostPath mounts."""
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    best: tuple[int, str] | None = None
    target = PurePosixPath(container_path)
    for mount in _container(daemonset)["volumeMounts"]:
        mount_path = PurePosixPath(mount["mountPath"])
        host = volumes[mount["name"]].get("hostPath")
        if host is None or not target.is_relative_to(mount_path):
            continue
        mapped = str(PurePosixPath(host["path"]) / target.relative_to(mount_path))
        depth = len(mount_path.parts)
        if best is None or depth > best[0]:
            best = (depth, mapped)
    return None if best is None else best[1]


def test_yaml_files_parse() -> None:
    kinds = [d["kind"] for d in _docs("rbac.yaml")] + [d["kind"] for d in _docs("daemonset.yaml")]
    assert sorted(kinds) == sorted(
        ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"]
    )


def test_shipped_config_is_valid(shipped_config: Config) -> None:
    assert shipped_config.reconciler.root == "/host"


@pytest.mark.parametrize(
    "host_path", ["/sys/fs/cgroup", "/sys/devices/system/node", "/proc/zoneinfo", "/proc/1/cgroup"]
)
def test_reconciler_root_reaches_the_host(
    daemonset: dict[str, Any], shipped_config: Config, host_path: str
) -> None:
    root = PurePosixPath(shipped_config.reconciler.root)
    inside = str(root / host_path.lstrip("/"))
    assert _host_path_of(daemonset, inside) == host_path


def test_resctrl_and_socket_are_mounted(
    daemonset: dict[str, Any], shipped_config: Config
) -> None:
    root = PurePosixPath(shipped_config.reconciler.root)
    inside = str(root / shipped_config.resctrl.root.lstrip("/"))
    assert _host_path_of(daemonset, inside) == shipped_config.resctrl.root == "/sys/fs/resctrl"
    socket = shipped_config.plugin.socket
    assert _host_path_of(daemonset, socket) == socket


def test_daemonset_runs_the_agent(daemonset: dict[str, Any]) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    container = _container(daemonset)
    assert pod["hostPID"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert container["securityContext"]["privileged"] is True
    assert container["command"][:2] == ["nri-qos", "run"]
    config_path = container["command"][container["command"].index("--config") + 1]
    (config_mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    assert PurePosixPath(config_path).parent == PurePosixPath(config_mount["mountPath"])
    (node_env,) = [e for e in container["env"] if e["name"] == "NODE_NAME"]
    assert node_env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])


def test_rbac_binds_the_daemonset_account(daemonset: dict[str, Any]) -> None:
    docs = _docs("rbac.yaml")
    account = _one(docs, "ServiceAccount")["metadata"]
    binding = _one(docs, "ClusterRoleBinding")
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == account["name"]
    assert daemonset["metadata"]["namespace"] == account["namespace"]
    assert binding["roleRef"]["name"] == _one(docs, "ClusterRole")["metadata"]["name"]
    (subject,) = binding["subjects"]
    assert subject == {
        "kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]
    }


def test_rbac_covers_every_api_call() -> None:
    source = (REPO / "reconciler" / "k8s.py").read_text()
    called = set(re.findall(r"core\.(\w+)\(", source))
    assert called, "no API calls found in k8s.py"
    unknown = called - set(API_CALLS)
    assert not unknown, f"map these calls to permissions in API_CALLS: {sorted(unknown)}"
    granted = {
        (group, resource, verb)
        for rule in _one(_docs("rbac.yaml"), "ClusterRole")["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    needed = set().union(*(API_CALLS[c] for c in called))
    assert needed - granted == set()
    # Least privilege: nothing beyond what the code uses.
    assert granted - needed == set()


def test_containerd_snippet_enables_nri(shipped_config: Config) -> None:
    text = (DEPLOY / "containerd-nri.toml").read_text()
    nri = tomllib.loads(text)["plugins"]["io.containerd.nri.v1.nri"]
    assert nri["disable"] is False
    assert nri["socket_path"] == shipped_config.plugin.socket
    budget_ms = shipped_config.plugin.deadline_ms + shipped_config.plugin.deadline_margin_ms
    assert float(nri["plugin_request_timeout"].removesuffix("s")) * 1000 >= budget_ms


def test_systemd_unit_runs_the_agent() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((DEPLOY / "nri-qos.service").read_text())
    exec_start = unit["Service"]["ExecStart"].split()
    assert PurePosixPath(exec_start[0]).name == "nri-qos"
    assert exec_start[1] == "run"
    assert exec_start[exec_start.index("--config") + 1] == "/etc/nri-qos/config.toml"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert "containerd.service" in unit["Unit"]["After"]


def test_only_k8s_module_imports_the_client() -> None:
    importers = {
        str(path.relative_to(REPO))
        for package in ("nri_plugin", "hooks", "reconciler")
        for path in (REPO / package).rglob("*.py")
        if re.search(r"^\s*(import|from) kubernetes\b", path.read_text(), re.MULTILINE)
    }
    assert importers == {str(Path(k8s.__file__).resolve().relative_to(REPO))}


def test_image_copies_every_package_it_installs() -> None:
    import tomllib

    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    top_level = {name.split(".")[0] for name in pyproject["tool"]["setuptools"]["packages"]}
    containerfile = (DEPLOY / "Containerfile").read_text()
    copied = {line.split()[1] for line in containerfile.splitlines()
              if line.startswith("COPY ")}
    assert top_level <= copied
    assert 'CMD ["run", "--config", "/etc/nri-qos/config.toml"]' in containerfile


def test_every_package_of_the_tree_is_installed() -> None:
    import tomllib

    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(DEPLOY.parent).parts)
        for top in ("nri_plugin", "hooks", "reconciler", "protos")
        for init in (DEPLOY.parent / top).rglob("__init__.py")
    }
    assert found == listed
    # Files the code opens at run time travel with the package.
    data = pyproject["tool"]["setuptools"]["package-data"]
    assert "scenarios/*.toml" in data["nri_plugin"]
