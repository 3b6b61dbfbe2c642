"""The agent's connection to the API server over real TLS sockets: the in-cluster service
account, a kubeconfig's CA, client certificates, tokens and server name, and the sources and
fields it refuses, each with the reason it gives."""

from __future__ import annotations

import base64
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from reconciler.kube import KubernetesConfig, build_api_client
from reconciler.kube.client import read_json
from reconciler.kube.credentials import CredentialsError, in_cluster
from reconciler.kube.errors import TRANSIENT, TRANSPORT, ApiError
from reconciler.kube.kubeconfig import MAX_BYTES, from_kubeconfig
from reconciler.kube.rest import Rest
from reconciler.kube.transport import Api
from tests.support.fake_apiserver import FakeApiServer, write_kubeconfig
from tests.support.pki import Authority, Pair

NODE = "/api/v1/nodes/node-a"


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    (tmp_path / "pki").mkdir()
    return Authority(tmp_path / "pki")


@pytest.fixture
def serving(ca: Authority) -> Pair:
    return ca.issue("apiserver", hosts=("127.0.0.1",))


@pytest.fixture
def tls(ca: Authority, serving: Pair) -> Iterator[FakeApiServer]:
    with FakeApiServer(tls=ca.server_context(serving)) as server:
        server.add_node("node-a")
        yield server


def get_node(api: Api) -> dict[str, Any]:
    body: dict[str, Any] = read_json(Rest(api).request("GET", NODE, timeout=5.0))
    return body


def connect(kubeconfig: Path) -> Api:
    with capture_logs() as logs:
        api = build_api_client(KubernetesConfig(kubeconfig=str(kubeconfig)))
    assert api is not None, logs
    return api


def refusal(kubeconfig: Path) -> str:
    """Why the agent could not use ``kubeconfig`` (its one ``tried`` line)."""
    with capture_logs() as logs:
        assert build_api_client(KubernetesConfig(kubeconfig=str(kubeconfig))) is None
    (warning,) = [e for e in logs if e["event"] == "kubernetes_unavailable"]
    (tried,) = warning["tried"]
    return str(tried)


# ---- in-cluster ---------------------------------------------------------------------------------


def service_account(directory: Path, ca: Authority, token: str) -> Path:
    directory.mkdir()
    (directory / "token").write_text(token + "\n")
    (directory / "ca.crt").write_bytes(ca.files.cert.read_bytes())
    return directory


def test_in_cluster_sends_the_service_account_token_read_again_as_kubelet_rewrites_it(
        tmp_path: Path, ca: Authority, tls: FakeApiServer) -> None:
    account = service_account(tmp_path / "sa", ca, "first")
    port = tls.url.rsplit(":", 1)[1]
    environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
    with capture_logs() as logs:
        api = build_api_client(KubernetesConfig(), environ, service_account=account)
    assert api is not None
    assert [(e["source"], e["host"]) for e in logs if e["event"] == "kubernetes_config"] == [
        ("in-cluster", tls.url)]
    assert get_node(api)["metadata"]["name"] == "node-a"
    (account / "token").write_text("second")
    get_node(api)
    assert [r.headers["authorization"] for r in tls.requests("GET")] == [
        "Bearer first", "Bearer second"]
    assert tls.requests("GET")[0].headers["user-agent"].startswith("nri-qos")
    api.close()


def test_in_cluster_needs_the_service_variables_a_token_and_the_ca(
        tmp_path: Path, ca: Authority) -> None:
    account = service_account(tmp_path / "sa", ca, "t")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster(env, account).server == "https://10.96.0.1:443"
    assert in_cluster({**env, "KUBERNETES_SERVICE_HOST": "fd00::1"}, account).server == \
        "https://[fd00::1]:443"
    with pytest.raises(CredentialsError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster({"KUBERNETES_SERVICE_PORT": "443"}, account)
    (account / "token").write_text("\n")
    with pytest.raises(CredentialsError, match=r"token file .* is empty"):
        in_cluster(env, account)
    (account / "token").unlink()
    with pytest.raises(CredentialsError, match=r"token file .*: No such file"):
        in_cluster(env, account)
    (account / "token").write_text("t")
    (account / "ca.crt").unlink()
    with pytest.raises(CredentialsError, match=r"ca\.crt is missing"):
        in_cluster(env, account)


def test_a_token_gone_at_request_time_is_a_transport_failure_the_watch_retries(
        tmp_path: Path, ca: Authority, tls: FakeApiServer) -> None:
    account = service_account(tmp_path / "sa", ca, "t")
    port = tls.url.rsplit(":", 1)[1]
    api = build_api_client(KubernetesConfig(), {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                                                "KUBERNETES_SERVICE_PORT": port},
                           service_account=account)
    assert api is not None
    (account / "token").unlink()
    with pytest.raises(CredentialsError) as raised:
        get_node(api)
    assert isinstance(raised.value, TRANSPORT)
    assert isinstance(raised.value, TRANSIENT)


# ---- TLS from a kubeconfig ----------------------------------------------------------------------


def test_the_server_is_checked_against_the_kubeconfig_ca_file_relative_to_it(
        tmp_path: Path, tls: FakeApiServer) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "pki" / "kubeconfig", tls.url, token="t",
                                  cluster={"certificate-authority": "cluster-ca.crt"})
    assert get_node(connect(kubeconfig))["metadata"]["name"] == "node-a"


def test_a_server_certificate_from_another_ca_is_refused(tmp_path: Path,
                                                         tls: FakeApiServer) -> None:
    (tmp_path / "other").mkdir()
    other = Authority(tmp_path / "other", "other-ca")
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", tls.url, cluster={
        "certificate-authority-data": base64.b64encode(other.files.cert.read_bytes()).decode()})
    api = connect(kubeconfig)
    with pytest.raises(TRANSPORT, match="CERTIFICATE_VERIFY_FAILED"):
        get_node(api)
    assert tls.requests() == []


def test_insecure_skip_tls_verify_takes_any_server_certificate(tmp_path: Path,
                                                               tls: FakeApiServer) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", tls.url,
                                  cluster={"insecure-skip-tls-verify": True})
    with capture_logs() as logs:
        api = build_api_client(KubernetesConfig(kubeconfig=str(kubeconfig)))
    assert api is not None
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["kubernetes_unverified"]
    assert get_node(api)["metadata"]["name"] == "node-a"
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", tls.url,
                                  cluster={"insecure-skip-tls-verify": "yes"})
    assert refusal(kubeconfig).endswith("insecure-skip-tls-verify: must be true or false")


def test_tls_server_name_checks_the_certificate_for_that_name(tmp_path: Path,
                                                              ca: Authority) -> None:
    named = ca.issue("named", hosts=("kubernetes.default.svc",))
    with FakeApiServer(tls=ca.server_context(named)) as server:
        server.add_node("node-a")
        ca_data = {"certificate-authority-data":
                   base64.b64encode(ca.files.cert.read_bytes()).decode()}
        plain = write_kubeconfig(tmp_path / "plain", server.url, cluster=ca_data)
        with pytest.raises(TRANSPORT, match=r"127\.0\.0\.1"):
            get_node(connect(plain))
        kubeconfig = write_kubeconfig(tmp_path / "named", server.url, cluster={
            **ca_data, "tls-server-name": "kubernetes.default.svc"})
        assert get_node(connect(kubeconfig))["metadata"]["name"] == "node-a"


def test_client_certificate_files_are_read_again_for_each_new_connection(
        tmp_path: Path, ca: Authority, serving: Pair) -> None:
    first = ca.issue("system:node:a", client=True)
    with FakeApiServer(tls=ca.server_context(serving, require_client=True)) as server:
        server.add_node("node-a")
        kubeconfig = write_kubeconfig(
            tmp_path / "pki" / "kubeconfig", server.url,
            cluster={"certificate-authority": "cluster-ca.crt"},
            user={"client-certificate": first.cert.name, "client-key": first.key.name})
        api = connect(kubeconfig)
        get_node(api)
        # kubelet rotates its client certificate by rewriting the files named
        second = ca.issue("system:node:b", client=True)
        first.cert.write_bytes(second.cert.read_bytes())
        first.key.write_bytes(second.key.read_bytes())
        api.close()
        get_node(api)
        assert [r.peer for r in server.requests("GET")] == ["system:node:a", "system:node:b"]
        bare = write_kubeconfig(tmp_path / "pki" / "bare", server.url,
                                cluster={"certificate-authority": "cluster-ca.crt"})
        with pytest.raises(TRANSPORT):
            get_node(connect(bare))
        assert len(server.requests("GET")) == 2


def test_client_certificate_data_leaves_no_key_on_disk(
        tmp_path: Path, ca: Authority, serving: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    client = ca.issue("admin", client=True)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    def data(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    with FakeApiServer(tls=ca.server_context(serving, require_client=True)) as server:
        server.add_node("node-a")
        kubeconfig = write_kubeconfig(
            tmp_path / "kubeconfig", server.url,
            cluster={"certificate-authority-data": data(ca.files.cert)},
            user={"client-certificate-data": data(client.cert),
                  "client-key-data": data(client.key)})
        get_node(connect(kubeconfig))
        assert [r.peer for r in server.requests("GET")] == ["admin"]
    assert list(scratch.iterdir()) == []


def test_a_token_file_named_in_the_kubeconfig_is_read_for_every_request(
        tmp_path: Path, tls: FakeApiServer) -> None:
    (tmp_path / "pki" / "token").write_text("one")
    kubeconfig = write_kubeconfig(tmp_path / "pki" / "kubeconfig", tls.url, user={
        "tokenFile": "token"}, cluster={"certificate-authority": "cluster-ca.crt"})
    api = connect(kubeconfig)
    get_node(api)
    (tmp_path / "pki" / "token").write_text("two")
    get_node(api)
    assert [r.headers["authorization"] for r in tls.requests("GET")] == [
        "Bearer one", "Bearer two"]


@pytest.mark.parametrize("user", [{"token": "stale"}, {"tokenFile": "token"}])
def test_a_refused_token_that_reads_the_same_again_gets_the_401_without_a_second_send(
        tmp_path: Path, tls: FakeApiServer, user: dict[str, str]) -> None:
    (tmp_path / "pki" / "token").write_text("stale")
    kubeconfig = write_kubeconfig(tmp_path / "pki" / "kubeconfig", tls.url, user=user,
                                  cluster={"certificate-authority": "cluster-ca.crt"})
    api = connect(kubeconfig)
    tls.token = "fresh"
    with pytest.raises(ApiError) as raised:
        get_node(api)
    assert raised.value.status == 401
    assert [(r.headers["authorization"], r.status) for r in tls.requests("GET")] == [
        ("Bearer stale", 401)]


# ---- what a kubeconfig may not say --------------------------------------------------------------


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("auth-provider", {"name": "oidc"}, "users[tester].user.auth-provider: not supported; use "
                                        "an exec plugin"),
    ("username", "admin", "users[tester].user.username: basic authentication is not supported"),
    ("password", "secret", "users[tester].user.password: basic authentication is not supported"),
    ("as", "system:admin", "users[tester].user.as: impersonation is not supported"),
    ("as-groups", ["system:masters"], "users[tester].user.as-groups: impersonation is not "
                                      "supported"),
])
def test_fields_that_would_change_who_the_agent_is_are_refused_by_name(
        tmp_path: Path, field: str, value: Any, reason: str) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:6443",
                                  user={field: value})
    assert refusal(kubeconfig) == f"kubeconfig {kubeconfig}: {reason}"


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda d: d.pop("current-context"), "current-context is not set"),
    (lambda d: d.update({"current-context": "elsewhere"}),
     "contexts has no entry named 'elsewhere'"),
    (lambda d: d["contexts"][0]["context"].update({"cluster": "gone"}),
     "clusters has no entry named 'gone'"),
    (lambda d: d["clusters"][0]["cluster"].update({"server": "127.0.0.1:6443"}),
     "clusters[fake].cluster.server: must be an http(s) URL, got '127.0.0.1:6443'"),
    (lambda d: d["clusters"][0]["cluster"].update({"proxy-url": "http://proxy:3128"}),
     "clusters[fake].cluster.proxy-url: not supported"),
    (lambda d: d["clusters"][0]["cluster"].update({"certificate-authority-data": "!!"}),
     "clusters[fake].cluster.certificate-authority-data: not base64"),
    (lambda d: d["clusters"][0]["cluster"].update({"certificate-authority": "nope.crt"}),
     "clusters[fake].cluster.certificate-authority: {dir}/nope.crt is not a file"),
    (lambda d: d["clusters"][0]["cluster"].update({"certificate-authority-data":
                                                   base64.b64encode(b"junk").decode()}),
     "ssl"),
    (lambda d: d.update({"users": {"tester": {}}}), "users is not a list"),
    (lambda d: d["users"][0]["user"].update({"client-certificate-data": "QQ=="}),
     "users[tester].user.client-certificate-data: needs client-key-data too"),
    (lambda d: d["users"][0]["user"].update({"client-key": "k.pem"}),
     "users[tester].user.client-key: needs client-certificate too"),
])
def test_a_kubeconfig_that_cannot_be_used_says_where(tmp_path: Path, edit: Any,
                                                     reason: str) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:6443")
    doc = yaml.safe_load(kubeconfig.read_text())
    edit(doc)
    kubeconfig.write_text(yaml.safe_dump(doc))
    said = refusal(kubeconfig)
    assert said.startswith(f"kubeconfig {kubeconfig}: ")
    assert reason.format(dir=tmp_path).lower() in said.lower()


def test_a_kubeconfig_is_read_up_to_one_mib(tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:6443")
    text = kubeconfig.read_text() + "#"
    kubeconfig.write_text(text + "x" * (MAX_BYTES - len(text)))
    assert kubeconfig.stat().st_size == MAX_BYTES
    assert from_kubeconfig(kubeconfig, 5.0).server == "https://127.0.0.1:6443"
    kubeconfig.write_text(text + "x" * (MAX_BYTES - len(text) + 1))
    with pytest.raises(CredentialsError, match=f"larger than {MAX_BYTES} bytes"):
        from_kubeconfig(kubeconfig, 5.0)


@pytest.mark.parametrize("nesting", [b"[" * 10_000 + b"]" * 10_000,
                                     b"{a: " * 10_000 + b"}" * 10_000])
def test_a_kubeconfig_nested_too_deeply_is_refused_like_any_unusable_one(
        tmp_path: Path, nesting: bytes) -> None:
    """The YAML loader recurses per level: its RecursionError is a refusal, not a crash."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_bytes(nesting)
    assert len(nesting) < MAX_BYTES
    assert refusal(kubeconfig) == (f"kubeconfig {kubeconfig}: not a kubeconfig: YAML nested "
                                   "too deeply to load")
