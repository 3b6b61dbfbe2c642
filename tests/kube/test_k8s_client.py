"""The kubernetes client the agent builds: the node's name, credentials and kubeconfig, and how it
degrades without them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from nri_plugin.config.loader import parse_toml
from nri_plugin.config.schema import Config
from reconciler.kube import KubernetesConfig, build_api_client, node_name
from reconciler.kube.client import read_json
from reconciler.kube.rest import Rest
from tests.support.fake_apiserver import FakeApiServer, make_pod, write_kubeconfig


# An API server that knows no node, unlike the suite's ``fake``: each module of these tests
# declares its own, as one in this folder's conftest would replace the suite's for its neighbours.
@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


# ---- configuration ------------------------------------------------------------------------------


def test_node_name_precedence() -> None:
    assert node_name(KubernetesConfig(node_name="cfg-node"), {"NODE_NAME": "env"}) == "cfg-node"
    assert node_name(KubernetesConfig(), {"NODE_NAME": "env-node"}) == "env-node"
    fallback = node_name(KubernetesConfig(), {})
    assert fallback
    assert fallback == fallback.lower()


def test_disabled_means_no_client() -> None:
    with capture_logs() as logs:
        assert build_api_client(KubernetesConfig(enabled=False)) is None
    assert [e["event"] for e in logs] == ["kubernetes_disabled"]


def test_no_credentials_degrade_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with capture_logs() as logs:
        client = build_api_client(KubernetesConfig(), {"HOME": str(tmp_path)})
    assert client is None
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ["kubernetes_unavailable"]
    tried = warnings[0]["tried"]
    assert tried[0].startswith("in-cluster")
    assert str(tmp_path / ".kube" / "config") in tried[1]


def test_configured_kubeconfig_that_is_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with capture_logs() as logs:
        assert build_api_client(KubernetesConfig(kubeconfig=str(missing))) is None
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert str(missing) in warning["tried"][0]


@pytest.mark.parametrize(
    "content", ["{not yaml: [", "apiVersion: v1\nkind: Config\n", "clusters: 5\n"]
)
def test_broken_kubeconfig_degrades(tmp_path: Path, content: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(content)
    with capture_logs() as logs:
        assert build_api_client(KubernetesConfig(kubeconfig=str(path))) is None
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["kubernetes_unavailable"]


@pytest.mark.parametrize("where", ["KUBECONFIG", "HOME"])
def test_default_kubeconfig(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeApiServer, where: str
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    fake.add_pod(make_pod("a"))
    (tmp_path / ".kube").mkdir()
    path = write_kubeconfig(tmp_path / ".kube" / "config", fake.url)
    environ = {"KUBECONFIG": str(path)} if where == "KUBECONFIG" else {"HOME": str(tmp_path)}
    client = build_api_client(KubernetesConfig(), environ)
    assert client is not None
    try:
        pods = read_json(Rest(client).request("GET", "/api/v1/pods", timeout=5.0))
        assert [p["metadata"]["name"] for p in pods["items"]] == ["a"]
    finally:
        client.close()


def test_a_configured_kubeconfig_is_one_file_even_with_a_colon_in_its_name(
        tmp_path: Path, fake: FakeApiServer) -> None:
    named = tmp_path / "a:b"
    write_kubeconfig(named, fake.url)
    cfg = parse_toml(Config, f'[kubernetes]\nkubeconfig = "{named}"\n', "x.toml").kubernetes
    assert cfg.kubeconfig == str(named)
    client = build_api_client(cfg)
    assert client is not None
    client.close()


def test_kubeconfig_variable_is_a_list_whose_first_existing_file_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeApiServer) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = write_kubeconfig(tmp_path / "second", fake.url)
    with capture_logs() as logs:
        client = build_api_client(KubernetesConfig(),
                                  {"KUBECONFIG": f"{tmp_path / 'first'}:{path}"})
    assert client is not None
    client.close()
    (line,) = [e for e in logs if e["event"] == "kubernetes_config"]
    assert line["source"] == f"kubeconfig {path}"
