"""Tokens from a kubeconfig's exec plugin: a real command run as kubectl runs it, its token sent,
kept until 30 s before its expiry and fetched again then, or at once when the server refuses
it; each way a plugin fails, named."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from reconciler.kube import KubernetesConfig, build_api_client
from reconciler.kube.client import read_json
from reconciler.kube.credentials import CredentialsError
from reconciler.kube.errors import ApiError
from reconciler.kube.exec_credential import EARLY, ExecToken, parse
from reconciler.kube.rest import Rest
from tests.support.fake_apiserver import FakeApiServer, write_kubeconfig

V1 = "client.authentication.k8s.io/v1"
EXPIRY = datetime(2030, 1, 1, tzinfo=UTC)

PLUGIN = """#!{python}
import json, os, pathlib, sys, time
here = pathlib.Path(__file__).parent
runs = here / "runs"
n = len(runs.read_text().splitlines()) + 1 if runs.exists() else 1
runs.write_text((runs.read_text() if runs.exists() else "") + "run\\n")
(here / "seen.json").write_text(json.dumps({{"info": json.loads(os.environ["KUBERNETES_EXEC_INFO"]),
                                             "region": os.environ.get("REGION"),
                                             "args": sys.argv[1:]}}))
mode = os.environ.get("MODE", "ok")
if mode == "fail":
    print("no credentials for this role", file=sys.stderr)
    sys.exit(3)
if mode == "slow":
    time.sleep(5)
if (here / "fail-next").exists():
    (here / "fail-next").unlink()
    print("role revoked", file=sys.stderr)
    sys.exit(4)
token = "tok-cached" if mode == "cached" else f"tok-{{n}}"
print(json.dumps({{"apiVersion": "{version}", "kind": "ExecCredential",
                   "status": {{"token": token, "expirationTimestamp": "{expiry}"}}}}))
"""


def plugin(directory: Path, version: str = V1) -> Path:
    path = directory / "bin" / "get-token"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PLUGIN.format(python=sys.executable, version=version,
                                  expiry=EXPIRY.strftime("%Y-%m-%dT%H:%M:%SZ")))
    path.chmod(0o755)
    return path


def exec_user(mode: str = "ok", **extra: Any) -> dict[str, Any]:
    return {"exec": {"apiVersion": V1, "command": "./bin/get-token", "args": ["--role", "node"],
                     "env": [{"name": "REGION", "value": "eu-1"}, {"name": "MODE",
                                                                    "value": mode}],
                     "interactiveMode": "Never", **extra}}


def tried(kubeconfig: Path, timeout_s: float = 10.0) -> str:
    with capture_logs() as logs:
        assert build_api_client(KubernetesConfig(kubeconfig=str(kubeconfig),
                                                 request_timeout_s=timeout_s)) is None
    (warning,) = [e for e in logs if e["event"] == "kubernetes_unavailable"]
    return str(warning["tried"][0])


def test_the_plugin_runs_once_as_kubectl_runs_it_and_its_token_goes_with_requests(
        tmp_path: Path) -> None:
    plugin(tmp_path)
    with FakeApiServer() as server:
        server.add_node("node-a")
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server.url,
                                      user=exec_user(provideClusterInfo=True))
        api = build_api_client(KubernetesConfig(kubeconfig=str(kubeconfig)))
        assert api is not None
        for _ in range(2):
            read_json(Rest(api).request("GET", "/api/v1/nodes/node-a", timeout=5.0))
        assert [r.headers["authorization"] for r in server.requests("GET")] == [
            "Bearer tok-1", "Bearer tok-1"]
    assert (tmp_path / "bin" / "runs").read_text() == "run\n"
    seen = json.loads((tmp_path / "bin" / "seen.json").read_text())
    assert seen["args"] == ["--role", "node"]
    assert seen["region"] == "eu-1"
    assert seen["info"] == {"apiVersion": V1, "kind": "ExecCredential",
                            "spec": {"interactive": False, "cluster": {"server": server.url}}}


def test_the_token_is_fetched_again_exactly_30_s_before_it_expires(tmp_path: Path) -> None:
    command = plugin(tmp_path)
    now = [EXPIRY - EARLY - timedelta(microseconds=1)]
    token = ExecToken(command=str(command), args=(), env={"MODE": "ok"}, api_version=V1,
                      timeout_s=10.0, clock=lambda: now[0])
    assert token.value() == "tok-1"
    assert token.value() == "tok-1"
    now[0] = EXPIRY - EARLY
    assert token.value() == "tok-2"
    assert timedelta(seconds=30) == EARLY


@pytest.mark.parametrize(("mode", "timeout_s", "said"), [
    ("fail", 10.0, "exited with 3: no credentials for this role"),
    ("slow", 0.5, "timed out after 0.5 seconds"),
])
def test_a_plugin_that_fails_leaves_the_agent_degraded_saying_why(
        tmp_path: Path, mode: str, timeout_s: float, said: str) -> None:
    plugin(tmp_path)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:6443",
                                  user=exec_user(mode))
    message = tried(kubeconfig, timeout_s)
    assert f"exec plugin {tmp_path}/bin/get-token" in message
    assert said in message


@pytest.mark.parametrize(("extra", "said"), [
    ({"interactiveMode": "Always"}, "users[tester].user.exec.interactiveMode: Always needs a "
                                    "terminal"),
    ({"apiVersion": "client.authentication.k8s.io/v1alpha1"},
     "users[tester].user.exec.apiVersion: one of"),
    ({"args": "--role node"}, "users[tester].user.exec.args: must be a list of strings"),
    ({"env": [{"name": "A"}]}, "users[tester].user.exec.env: must be a list of {name, value}"),
])
def test_a_plugin_the_agent_cannot_run_is_refused_by_field(tmp_path: Path, extra: Any,
                                                           said: str) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:6443",
                                  user=exec_user(**extra))
    assert said in tried(kubeconfig)


@pytest.mark.parametrize(("output", "said"), [
    (b"not json", "printed no JSON"),
    (b"[" * 10_000 + b"]" * 10_000, "printed no JSON: JSON nested too deeply"),
    (b'{"kind": "Other"}', "printed no ExecCredential"),
    (json.dumps({"kind": "ExecCredential", "apiVersion": "client.authentication.k8s.io/v1beta1",
                 "status": {"token": "t"}}).encode(),
     "answered 'client.authentication.k8s.io/v1beta1' to a request for"),
    (json.dumps({"kind": "ExecCredential", "apiVersion": V1, "status": {
        "clientCertificateData": "PEM", "clientKeyData": "PEM"}}).encode(),
     "status.token is missing (a client certificate from an exec plugin is not supported)"),
    (json.dumps({"kind": "ExecCredential", "apiVersion": V1, "status": {
        "token": "t", "expirationTimestamp": "tomorrow"}}).encode(),
     "status.expirationTimestamp 'tomorrow'"),
    (json.dumps({"kind": "ExecCredential", "apiVersion": V1, "status": {
        "token": "t", "expirationTimestamp": "2030-01-01T00:00:00"}}).encode(), "has no zone"),
])
def test_what_a_plugin_prints_is_checked(output: bytes, said: str) -> None:
    with pytest.raises(CredentialsError, match="plugin x") as raised:
        parse(output, V1, "plugin x")
    assert said in str(raised.value)


def test_a_credential_without_expiry_is_kept(tmp_path: Path) -> None:
    out = json.dumps({"kind": "ExecCredential", "apiVersion": V1, "status": {"token": "t"}})
    assert parse(out.encode(), V1, "p") == ("t", None)


def served(tmp_path: Path, server: FakeApiServer, mode: str = "ok") -> Rest:
    plugin(tmp_path)
    server.add_node("node-a")
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server.url, user=exec_user(mode))
    api = build_api_client(KubernetesConfig(kubeconfig=str(kubeconfig)))
    assert api is not None
    return Rest(api)


def runs(tmp_path: Path) -> int:
    return len((tmp_path / "bin" / "runs").read_text().splitlines())


def seen(server: FakeApiServer, method: str) -> list[tuple[str, int]]:
    return [(r.headers["authorization"], r.status) for r in server.requests(method)]


def test_a_token_the_server_refuses_is_fetched_again_and_the_request_sent_once_more(
        tmp_path: Path) -> None:
    with FakeApiServer(token="tok-1") as server:
        rest = served(tmp_path, server)
        read_json(rest.request("GET", "/api/v1/nodes/node-a", timeout=5.0))
        server.token = "tok-2"  # revoked long before its expiry in 2030
        with capture_logs() as logs:
            node = read_json(rest.request("GET", "/api/v1/nodes/node-a", timeout=5.0))
        assert node["metadata"]["name"] == "node-a"
        assert seen(server, "GET") == [("Bearer tok-1", 200), ("Bearer tok-1", 401),
                                       ("Bearer tok-2", 200)]
        assert runs(tmp_path) == 2
        assert [e["event"] for e in logs] == ["kubernetes_token_refused"]
        read_json(rest.request("GET", "/api/v1/nodes/node-a", timeout=5.0))
        assert runs(tmp_path) == 2


def test_a_refused_post_is_sent_again_with_its_body(tmp_path: Path) -> None:
    event = {"metadata": {"name": "e1", "namespace": "default"},
             "involvedObject": {"kind": "Pod", "namespace": "default", "name": "p"},
             "reason": "Evicted"}
    with FakeApiServer(token="tok-2") as server:
        rest = served(tmp_path, server)
        created = read_json(rest.request("POST", "/api/v1/namespaces/default/events",
                                         timeout=5.0, body=event))
        assert created["reason"] == "Evicted"
        assert seen(server, "POST") == [("Bearer tok-1", 401), ("Bearer tok-2", 201)]
        assert [r.body for r in server.requests("POST")] == [event, event]


def test_a_plugin_that_hands_back_the_refused_token_gets_the_401_without_a_second_send(
        tmp_path: Path) -> None:
    # kubelogin, for one, answers from its own cache until the token's expiry.
    with FakeApiServer(token="another") as server:
        rest = served(tmp_path, server, mode="cached")
        with pytest.raises(ApiError) as raised:
            rest.request("GET", "/api/v1/nodes/node-a", timeout=5.0)
        assert raised.value.status == 401
        assert seen(server, "GET") == [("Bearer tok-cached", 401)]
        assert runs(tmp_path) == 2


def test_a_plugin_that_fails_after_a_refusal_fails_the_request_and_runs_again_on_the_next(
        tmp_path: Path) -> None:
    with FakeApiServer(token="tok-3") as server:
        rest = served(tmp_path, server)
        (tmp_path / "bin" / "fail-next").touch()
        with pytest.raises(CredentialsError, match="exited with 4: role revoked"):
            rest.request("GET", "/api/v1/nodes/node-a", timeout=5.0)
        read_json(rest.request("GET", "/api/v1/nodes/node-a", timeout=5.0))
        assert seen(server, "GET") == [("Bearer tok-1", 401), ("Bearer tok-3", 200)]
        assert runs(tmp_path) == 3


def test_requests_refused_with_one_token_run_the_plugin_once(tmp_path: Path) -> None:
    token = ExecToken(command=str(plugin(tmp_path)), args=(), env={"MODE": "ok"},
                      api_version=V1, timeout_s=10.0)
    assert token.value() == "tok-1"
    assert token.refused("tok-1")
    assert token.refused("tok-1")
    assert token.value() == "tok-2"
    assert token.refused("tok-1")  # a late answer to a request sent with the old one
    assert token.value() == "tok-2"
    assert runs(tmp_path) == 2
