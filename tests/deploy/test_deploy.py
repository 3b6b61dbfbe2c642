"""The deployment files: the kustomize base and overlay build and parse into the Kubernetes
client's models, mount what the shipped configuration points at, and run the agent; the
containerd snippets, the systemd unit, the pre-installed wrapper (under the runtime's empty
environment) and the image definition are consistent with the code.

The kustomize build needs ``kustomize`` or ``kubectl kustomize`` on PATH; without either those
tests skip, and everything else reads the base's files directly.
"""

from __future__ import annotations

import asyncio
import configparser
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path, PurePosixPath

import pytest
import yaml

from nri_plugin.cli.nri_qos import build_parser
from nri_plugin.config.schema import Config
from nri_plugin.config.store import DEFAULT_CONFIG_PATH, load_layered
from nri_plugin.connection import ENV_INDEX, ENV_NAME, ENV_SOCKET
from reconciler import kube
from tests.support.manifests import (
    BASE,
    CANARY,
    COMPONENTS,
    DEPLOY,
    WRAPPER,
    Doc,
    assert_parses_into_models,
    base_docs,
    built,
    container_of,
    one,
    yaml_docs,
)
from tests.support.paths import REPO
from tests.support.prelaunch import create_one_container_then_go


@pytest.fixture(scope="module")
def daemonset() -> Doc:
    return one(base_docs(), "DaemonSet")


def config_of(configmap: Doc) -> Config:
    """The configuration the agent reads from the ConfigMap's drop-ins, mounted as the
    DaemonSet mounts them: the embedded defaults with the files of ``config.toml.d``."""
    with tempfile.TemporaryDirectory() as tmp:
        main = Path(tmp) / "config.toml"
        directory = Path(tmp) / "config.toml.d"
        directory.mkdir()
        for name, text in configmap["data"].items():
            (directory / name).write_text(text)
        config: Config = load_layered(None, default_path=str(main)).config
    return config


@pytest.fixture(scope="module")
def shipped_config() -> Config:
    return config_of(one(base_docs(), "ConfigMap"))


def _host_path_of(daemonset: Doc, container_path: str) -> str | None:
    """The host path a container path lands on, through the pod's hostPath mounts."""
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    best: tuple[int, str] | None = None
    target = PurePosixPath(container_path)
    for mount in container_of(daemonset)["volumeMounts"]:
        mount_path = PurePosixPath(mount["mountPath"])
        host = volumes[mount["name"]].get("hostPath")
        if host is None or not target.is_relative_to(mount_path):
            continue
        mapped = str(PurePosixPath(host["path"]) / target.relative_to(mount_path))
        depth = len(mount_path.parts)
        if best is None or depth > best[0]:
            best = (depth, mapped)
    return None if best is None else best[1]


def test_base_lists_its_resources() -> None:
    assert sorted(d["kind"] for d in base_docs()) == sorted(
        ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"])


def test_base_manifests_parse_into_client_models() -> None:
    assert_parses_into_models(base_docs())


def test_a_misspelled_field_is_caught() -> None:
    daemonset = json.loads(json.dumps(one(base_docs(), "DaemonSet")))
    daemonset["spec"]["template"]["spec"]["priorityClass"] = "system-node-critical"
    with pytest.raises(AssertionError, match="fields the model does not know"):
        assert_parses_into_models([daemonset])


@pytest.mark.parametrize("directory", [BASE, CANARY], ids=["base", "canary"])
def test_kustomize_builds_into_client_models(directory: Path) -> None:
    docs = built(directory)
    assert_parses_into_models(docs)
    configmap = one(docs, "ConfigMap")
    daemonset = one(docs, "DaemonSet")
    # The generated name carries the content's hash and the DaemonSet follows it.
    assert re.fullmatch(r"nri-qos-config-[a-z0-9]{10}", configmap["metadata"]["name"])
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "nri-qos"
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == "kube-system"
    config_of(configmap)


def test_canary_overlay_selects_canary_nodes_and_observes() -> None:
    docs = built(CANARY)
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "nri-qos.io/canary": "true"}
    # The image comes from the base's one images: entry.
    assert container_of(one(docs, "DaemonSet"))["image"] == "registry.example.com/nri-qos:0.1.0"
    configmap = one(docs, "ConfigMap")
    assert set(configmap["data"]) == {"00-daemonset.toml"}
    assert config_of(configmap).agent.mode == "observe"


def test_the_image_is_named_once() -> None:
    (image,) = yaml.safe_load((BASE / "kustomization.yaml").read_text())["images"]
    assert image["name"] == container_of(one(base_docs(), "DaemonSet"))["image"] == "nri-qos"
    for kustomization in (DEPLOY / "kustomize").rglob("kustomization.yaml"):
        if kustomization.parent != BASE:
            assert "images" not in yaml.safe_load(kustomization.read_text()), kustomization


def _with_component(tmp_path: Path, component: str) -> list[Doc]:
    """The base with one component, as an overlay in ``tmp_path`` would use it."""
    # kustomize takes only relative references.
    base = os.path.relpath(BASE, tmp_path)
    used = os.path.relpath(COMPONENTS / component, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{base}]\ncomponents: [{used}]\n")
    return built(tmp_path)


def test_no_resctrl_component_is_a_drop_in(tmp_path: Path) -> None:
    docs = _with_component(tmp_path, "no-resctrl")
    assert_parses_into_models(docs)
    configmap = one(docs, "ConfigMap")
    assert set(configmap["data"]) == {"00-daemonset.toml", "20-no-resctrl.toml"}
    config = config_of(configmap)
    assert config.resctrl.enabled is False
    assert config.reconciler.root == "/host"  # the base's file still applies
    assert one(docs, "DaemonSet")["spec"] == one(built(BASE), "DaemonSet")["spec"] | {
        "template": one(docs, "DaemonSet")["spec"]["template"]}


def test_enforce_component_switches_the_mode_and_rolls_the_daemonset(tmp_path: Path) -> None:
    docs = _with_component(tmp_path, "enforce")
    configmap = one(docs, "ConfigMap")
    assert set(configmap["data"]) == {"00-daemonset.toml", "90-enforce.toml"}
    assert config_of(configmap).agent.mode == "enforce"
    # Another name (hash): the DaemonSet's pods are replaced node by node.
    base_name = one(built(BASE), "ConfigMap")["metadata"]["name"]
    assert configmap["metadata"]["name"] != base_name
    volumes = {v["name"]: v for v in one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]


def test_privileged_component_makes_the_agent_privileged(tmp_path: Path) -> None:
    docs = _with_component(tmp_path, "privileged")
    assert_parses_into_models(docs)
    assert container_of(one(docs, "DaemonSet"))["securityContext"] == {"privileged": True}


def test_drop_ins_of_overlays_and_components_repeat_nothing_of_the_base() -> None:
    base = tomllib.loads((BASE / "00-daemonset.toml").read_text())
    dropped = [p for p in (DEPLOY / "kustomize").rglob("*.toml") if p.parent != BASE]
    assert dropped
    for path in dropped:
        for section, values in tomllib.loads(path.read_text()).items():
            assert not set(values) & set(base.get(section, {})), path


def test_shipped_config_is_valid(shipped_config: Config) -> None:
    assert shipped_config.reconciler.root == "/host"
    assert shipped_config.kubernetes.enabled is True


@pytest.mark.parametrize(
    "host_path", ["/sys/fs/cgroup", "/sys/devices/system/node", "/proc/zoneinfo", "/proc/1/cgroup",
                  "/proc/1/oom_score_adj", "/proc/pressure/memory"]
)
def test_reconciler_root_reaches_the_host(
    daemonset: Doc, shipped_config: Config, host_path: str
) -> None:
    root = PurePosixPath(shipped_config.reconciler.root)
    inside = str(root / host_path.lstrip("/"))
    assert _host_path_of(daemonset, inside) == host_path


def test_a_drop_cache_timeout_stays_below_the_termination_grace_period(
        daemonset: Doc, shipped_config: Config) -> None:
    grace = daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert shipped_config.mitigation.drop_cache.timeout_s < grace


def test_the_state_directory_is_the_hosts(daemonset: Doc, shipped_config: Config) -> None:
    """What to restore must outlive the pod: a new pod, or nri-qos reset, reads it."""
    assert _host_path_of(daemonset, shipped_config.reconciler.state_dir) == \
        shipped_config.reconciler.state_dir


def test_host_paths_are_only_what_the_agent_uses(daemonset: Doc) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    host_paths = {v["hostPath"]["path"]: v["name"] for v in pod["volumes"] if "hostPath" in v}
    assert set(host_paths) == {"/var/run/nri", "/sys/fs", "/sys/devices/system/node",
                               "/proc", "/var/lib/nri-qos/eviction-plugins", "/run/nri-qos",
                               "/var/lib/nri-qos/state"}
    mounts = {m["name"]: m for m in container_of(daemonset)["volumeMounts"]}
    # Only read: the NUMA topology and the configuration.
    assert mounts[host_paths["/sys/devices/system/node"]].get("readOnly") is True
    assert mounts["config"].get("readOnly") is True
    # resctrl through its parent, which every node has: mounted by the host possibly after
    # the pod started, or never.
    assert mounts[host_paths["/sys/fs"]]["mountPropagation"] == "HostToContainer"
    pod_volumes = {v["name"]: v for v in pod["volumes"]}
    assert pod_volumes[host_paths["/sys/fs"]]["hostPath"]["type"] == "Directory"


def test_resctrl_and_socket_are_mounted(daemonset: Doc, shipped_config: Config) -> None:
    root = PurePosixPath(shipped_config.reconciler.root)
    inside = str(root / shipped_config.resctrl.root.lstrip("/"))
    assert _host_path_of(daemonset, inside) == shipped_config.resctrl.root == "/sys/fs/resctrl"
    socket_path = shipped_config.plugin.socket
    assert _host_path_of(daemonset, socket_path) == socket_path


def test_eviction_plugin_sockets_are_shared_with_the_host(
    daemonset: Doc, shipped_config: Config
) -> None:
    # Plugins running on the host (or in other pods mounting it) must reach the same directory.
    directory = shipped_config.eviction.plugin_dir
    assert _host_path_of(daemonset, f"{directory}/example.sock") == f"{directory}/example.sock"


def test_daemonset_runs_the_agent(daemonset: Doc, shipped_config: Config) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    container = container_of(daemonset)
    assert pod["hostPID"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"]["kubernetes.io/os"] == "linux"
    # A percentage, each batch ready for a while before the next.
    assert re.fullmatch(r"\d+%", daemonset["spec"]["updateStrategy"]["rollingUpdate"]
                        ["maxUnavailable"])
    assert daemonset["spec"]["minReadySeconds"] >= 10
    security = container["securityContext"]
    assert security["privileged"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {
        "drop": ["ALL"], "add": ["DAC_OVERRIDE", "SYS_NICE", "SYS_PTRACE", "SYS_RESOURCE"]}
    args = build_parser().parse_args(container["command"][1:])
    assert container["command"][0] == "nri-qos"
    assert args.command == "run"
    (config_mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    # The default path, whose drop-in directory the ConfigMap is.
    assert args.config is None
    assert config_mount["mountPath"] == f"{DEFAULT_CONFIG_PATH}.d"
    (node_env,) = [e for e in container["env"] if e["name"] == "NODE_NAME"]
    assert node_env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Requests only for CPU (throttling delays NRI answers), a memory limit kept.
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    assert set(container["resources"]["limits"]) == {"memory"}
    # The status socket's directory is the host's (writable on a read-only root): a second
    # agent on the node finds this one there.
    status_dir = str(PurePosixPath(shipped_config.status.socket).parent)
    volumes = {v["name"]: v for v in pod["volumes"]}
    (status_mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == status_dir]
    assert volumes[status_mount["name"]]["hostPath"]["path"] == status_dir


def test_probes_ask_the_metrics_endpoint(daemonset: Doc, shipped_config: Config) -> None:
    container = container_of(daemonset)
    metrics = shipped_config.metrics
    assert metrics.enabled is True
    # The kubelet probes the pod's IP: the endpoint listens there, given on the command line
    # (tests/deploy/test_monitoring.py), not on the loopback address of the configuration.
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.metrics_address == "$(POD_IP)"
    (port,) = container["ports"]
    assert (port["name"], port["containerPort"]) == ("metrics", metrics.port)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics.port)


def test_the_reset_job_sees_an_agent_answering_on_the_node(
        daemonset: Doc, shipped_config: Config) -> None:
    """``nri-qos reset`` refuses to run while an agent answers on the status socket (a pod of
    the deleted DaemonSet still in its grace period, a systemd agent): it must look at the
    host's socket, where the DaemonSet's agent serves it, not at a directory of its own."""
    (job,) = yaml_docs((DEPLOY / "uninstall" / "reset-job.yaml").read_text())
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    status_dir = str(PurePosixPath(shipped_config.status.socket).parent)
    volumes = {v["name"]: v for v in pod["volumes"]}
    (status_mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == status_dir]
    assert volumes[status_mount["name"]].get("hostPath", {}).get("path") == _host_path_of(
        daemonset, status_dir)
    assert not status_mount.get("readOnly", False)  # it removes a socket left behind


def test_rbac_binds_the_daemonset_account(daemonset: Doc) -> None:
    docs = base_docs()
    account = one(docs, "ServiceAccount")["metadata"]
    binding = one(docs, "ClusterRoleBinding")
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == account["name"]
    assert daemonset["metadata"]["namespace"] == account["namespace"]
    assert binding["roleRef"]["name"] == one(docs, "ClusterRole")["metadata"]["name"]
    (subject,) = binding["subjects"]
    assert subject == {
        "kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]
    }


@pytest.mark.parametrize(("name", "version"), [("containerd-1.7.toml", 2),
                                               ("containerd-2.x.toml", 3)])
def test_containerd_snippets_enable_nri(shipped_config: Config, name: str, version: int) -> None:
    snippet = tomllib.loads((DEPLOY / "containerd" / name).read_text())
    assert snippet["version"] == version
    nri = snippet["plugins"]["io.containerd.nri.v1.nri"]
    assert nri["disable"] is False
    assert nri["disable_connections"] is False
    assert nri["socket_path"] == shipped_config.plugin.socket
    assert nri["plugin_path"] == "/opt/nri/plugins"
    budget_ms = shipped_config.plugin.deadline_ms + shipped_config.plugin.deadline_margin_ms
    assert float(nri["plugin_request_timeout"].removesuffix("s")) * 1000 >= budget_ms
    registration_ms = float(nri["plugin_registration_timeout"].removesuffix("s")) * 1000
    assert registration_ms <= shipped_config.plugin.register_timeout_ms


def test_systemd_unit_runs_the_agent() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((DEPLOY / "nri-qos.service").read_text())
    exec_start = unit["Service"]["ExecStart"].split()
    assert PurePosixPath(exec_start[0]).is_absolute()
    assert PurePosixPath(exec_start[0]).name == "nri-qos"
    args = build_parser().parse_args(exec_start[1:])
    assert (args.command, args.config) == ("run", None)  # the default path, its drop-ins
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert "containerd.service" in unit["Unit"]["After"]
    # The status socket's directory, root only.
    assert "/run/" + unit["Service"]["RuntimeDirectory"] == str(
        PurePosixPath(Config().status.socket).parent)
    assert unit["Service"]["RuntimeDirectoryMode"] == "0700"


def test_wrapper_is_named_and_written_for_an_empty_environment() -> None:
    assert re.fullmatch(r"[0-9]{2}-[A-Za-z0-9_.+-]+", WRAPPER.name)
    assert WRAPPER.stat().st_mode & 0o111 == 0o111
    lines = WRAPPER.read_text().splitlines()
    assert lines[0] == "#!/bin/sh"
    settings = dict(line.split("=", 1) for line in lines if re.match(r"^[A-Z]+=", line))
    # No PATH to look commands up in: every program and file is named by its absolute path.
    assert all(value.startswith("/") for value in settings.values())
    (exec_line,) = [line for line in lines if line.startswith("exec ")]
    assert exec_line.startswith('exec "$PYTHON" -I -m nri_plugin run ')


async def test_wrapper_runs_under_the_runtimes_empty_environment(tmp_path: Path) -> None:
    """The wrapper, with its paths pointed at this checkout's interpreter and a temporary
    config and log, started the way containerd starts a pre-installed plugin."""
    config = tmp_path / "config.toml"
    config.write_text("[resctrl]\nenabled = false\n[reconciler]\nenabled = false\n"
                      "[status]\nenabled = false\n")
    log = tmp_path / "nri-qos.log"
    text = WRAPPER.read_text()
    text = re.sub(r"(?m)^PYTHON=.*$", f"PYTHON={sys.executable}", text)
    text = re.sub(r"(?m)^CONFIG=.*$", f"CONFIG={config}", text)
    text = re.sub(r"(?m)^LOG=.*$", f"LOG={log}", text)
    wrapper = tmp_path / WRAPPER.name
    wrapper.write_text(text)
    wrapper.chmod(0o755)
    runtime_end, plugin_end = socket.socketpair()
    fd = plugin_end.fileno()
    child = await asyncio.create_subprocess_exec(
        str(wrapper), pass_fds=(fd,), cwd=tmp_path,
        env={ENV_SOCKET: str(fd), ENV_NAME: "nri-qos", ENV_INDEX: "10"},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    plugin_end.close()
    try:
        await create_one_container_then_go(runtime_end, tmp_path)
    finally:
        async with asyncio.timeout(30):
            await child.wait()
    assert child.returncode == 0, log.read_text()
    # The log went to the file: the runtime discards stdout and stderr.
    assert f'"source":"{config}"' in log.read_text()


def test_image_copies_every_package_it_installs() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    # The packages setuptools finds: every included top-level name that is a directory here.
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    top_level = {name.rstrip("*") for name in patterns if (REPO / name.rstrip("*")).is_dir()}
    assert {"nri_plugin", "reconciler", "hooks", "protos"} <= top_level
    containerfile = (DEPLOY / "Containerfile").read_text()
    copies = [line.split()[1:] for line in containerfile.splitlines()
              if line.startswith("COPY ") and "--from=" not in line]
    sources = {source for parts in copies for source in parts[:-1]}
    assert top_level <= sources
    # Everything copied exists, from the repository root (the build context).
    assert all((REPO / source).exists() for source in sources)
    assert pyproject["project"]["readme"] in sources
    assert "pyproject.toml" in sources


def test_image_runs_the_agent_with_the_daemonset_config(daemonset: Doc) -> None:
    containerfile = (DEPLOY / "Containerfile").read_text()
    images = re.findall(r"(?m)^FROM python:(\d+)\.(\d+)", containerfile)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    minimum = tuple(map(int, pyproject["project"]["requires-python"].removeprefix(">=")
                        .split(".")))
    assert images
    assert all(tuple(map(int, image)) >= minimum for image in images)
    entrypoint = json.loads(re.search(r"(?m)^ENTRYPOINT (.*)$", containerfile)[1])  # type: ignore[index]
    cmd = json.loads(re.search(r"(?m)^CMD (.*)$", containerfile)[1])  # type: ignore[index]
    assert entrypoint == ["nri-qos"]
    args = build_parser().parse_args(cmd)
    assert args.command == "run"
    assert [*entrypoint, *cmd] == container_of(daemonset)["command"]


def test_image_smoke_commands_pass() -> None:
    """The image's build runs the installed command; the same commands pass here."""
    containerfile = (DEPLOY / "Containerfile").read_text()
    (smoke,) = re.findall(r"(?m)^RUN (nri-qos .*)$", containerfile)
    for command in smoke.split("&&"):
        words = command.replace(">", " ").split()
        words = [w for w in words if w != "/dev/null"]
        assert words[0] == "nri-qos"
        result = subprocess.run([sys.executable, "-m", "nri_plugin", *words[1:]], cwd="/",
                                capture_output=True, text=True, check=False, timeout=60)
        assert result.returncode == 0, result.stderr


def test_only_the_kube_package_holds_the_connection_and_no_module_imports_the_client() -> None:
    def importers(module: str) -> set[Path]:
        return {path.relative_to(REPO)
                for package in ("nri_plugin", "hooks", "reconciler", "common")
                for path in (REPO / package).rglob("*.py")
                if re.search(rf"^\s*(import|from) {module}\b", path.read_text(), re.MULTILINE)}

    # The kubernetes client costs every node about 12 MiB (reconciler/kube/transport.py).
    assert importers("kubernetes") == set()
    package = Path(kube.__file__).resolve().parent.relative_to(REPO)
    assert {path.parent for path in importers("urllib3")} == {package}


def test_every_package_of_the_tree_is_installed() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    # setuptools finds every directory with an __init__.py under an included name (no
    # namespace packages).
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    assert find["namespaces"] is False
    assert {"nri_plugin*", "hooks*", "reconciler*", "common*", "protos*"} <= set(find["include"])
    assert {"tests*", "bench*"} <= set(find["exclude"])
    for top in ("nri_plugin", "hooks", "reconciler", "common", "protos"):
        packages = {path.parent for path in (REPO / top).rglob("*.py")}
        assert all((package / "__init__.py").is_file() for package in packages)
    # Files the code opens at run time travel with the package.
    data = pyproject["tool"]["setuptools"]["package-data"]
    assert "*.toml" in data["nri_plugin.sim"]
    assert (REPO / "nri_plugin" / "sim" / "default_scenario.toml").is_file()
