"""How the agent sends its requests (:mod:`reconciler.kube.rest`): the API's own paths, query
and headers, errors as :class:`ApiError`, and never through the kubernetes client, whose
memory every node would pay."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reconciler.kube import KubernetesConfig
from reconciler.kube.client import read_json
from reconciler.kube.errors import ApiError
from reconciler.kube.rest import MERGE_PATCH, Rest, segment
from tests.support.fake_apiserver import (
    FakeApiServer,
    api_client,
    client_config,
    make_pod,
    write_kubeconfig,
)
from tests.support.paths import REPO


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.add_node("node-a")
        yield server


@pytest.fixture
def cfg(tmp_path: Path, fake: FakeApiServer) -> KubernetesConfig:
    return client_config(tmp_path, fake, request_timeout_s=5.0, retry_max_s=0.2)


def test_a_name_is_one_path_segment() -> None:
    assert segment("node-a") == "node-a"
    assert segment("a/b") == "a%2Fb"
    # quote() keeps dots; the API refuses "." and ".." as names (path segment names), so
    # none reaches a path here
    assert segment("..") == ".."


def test_a_get_sends_the_api_path_query_and_accept(fake: FakeApiServer, api: Any) -> None:
    fake.add_pod(make_pod("a", node="node-a"))
    fake.add_pod(make_pod("b", node="node-b"))
    body = read_json(Rest(api).request("GET", "/api/v1/pods", timeout=5.0,
                                       query=[("fieldSelector", "spec.nodeName=node-a")]))
    assert [pod["metadata"]["name"] for pod in body["items"]] == ["a"]
    (sent,) = fake.requests("GET")
    assert sent.query == {"fieldSelector": "spec.nodeName=node-a"}
    assert sent.headers["accept"] == "application/json"


def test_a_patch_sends_its_body_as_the_content_type_given(fake: FakeApiServer, api: Any) -> None:
    patch = {"metadata": {"labels": {"x": "1"}}}
    read_json(Rest(api).request("PATCH", "/api/v1/nodes/node-a", body=patch,
                                content_type=MERGE_PATCH, timeout=5.0))
    (sent,) = fake.requests("PATCH")
    assert sent.headers["content-type"] == MERGE_PATCH
    assert sent.body == patch
    assert fake.node("node-a")["metadata"]["labels"] == {"x": "1"}


def test_an_error_raises_with_the_status_sent_and_frees_the_connection(
    fake: FakeApiServer, api: Any
) -> None:
    rest = Rest(api)
    with pytest.raises(ApiError) as raised:
        rest.request("GET", "/api/v1/nodes/missing", timeout=5.0)
    assert raised.value.status == 404
    assert json.loads(raised.value.body or "")["reason"] == "NotFound"
    # The connection went back to the pool with its body read: the next answer is whole.
    for _ in range(3):
        assert read_json(rest.request("GET", "/api/v1/nodes/node-a", timeout=5.0))[
            "metadata"]["name"] == "node-a"


def test_a_bearer_token_goes_with_every_request(tmp_path: Path) -> None:
    with FakeApiServer(token="right") as fake:
        fake.add_node("node-a")
        for token, answer in (("wrong", 401), ("right", 200)):
            cfg = KubernetesConfig(kubeconfig=str(write_kubeconfig(
                tmp_path / f"kc-{token}", fake.url, token=token)))
            with api_client(cfg) as api:
                try:
                    read_json(Rest(api).request("GET", "/api/v1/nodes/node-a", timeout=5.0))
                    status = 200
                except ApiError as exc:
                    status = exc.status
            assert status == answer


# Every request the agent makes, in a fresh interpreter that imported the whole agent as
# ``nri-qos run`` does; then whether the kubernetes client (or pydantic, which it brings) was
# ever loaded: about 12 MiB on every node (reconciler/kube/transport.py).
EVERY_REQUEST = """
import asyncio, sys
import nri_plugin.agent  # everything the running agent imports
from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import OwnerRef
from reconciler.kube import KubeActions, KubernetesConfig, PodRef, PodWatcher, build_api_client

async def main() -> None:
    cfg = KubernetesConfig(kubeconfig=sys.argv[1], request_timeout_s=5.0)
    api = build_api_client(cfg)
    actions = KubeActions(api, cfg, AuditLog(MemoryAuditSink()))
    seen = asyncio.Event()
    stop = asyncio.Event()
    watch = asyncio.create_task(PodWatcher(api, cfg, "node-a").run(lambda _: seen.set(), stop))
    await asyncio.wait_for(seen.wait(), 10)
    assert (await actions.add_taint("node-a", "k", "v", "NoSchedule")).value == "changed"
    assert (await actions.set_node_condition("node-a", "C", True, "R", "m")).value == "changed"
    assert await actions.create_pod_event(PodRef("default", "p", "uid-p"), "node-a", "R", "m")
    assert await actions.owner_exists("default", OwnerRef("apps/v1", "DaemonSet", "d", "u")) \\
        is False
    assert (await actions.evict("default", "p", 30, False)).outcome.value == "evicted"
    stop.set()
    await watch
    api.close()

asyncio.run(main())
print(sorted(name for name in sys.modules if name.split(".")[0] in ("kubernetes", "pydantic")))
"""


def test_the_agent_never_loads_the_kubernetes_client(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    fake.add_pod(make_pod("p", node="node-a"))
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url)
    done = subprocess.run([sys.executable, "-c", EVERY_REQUEST, str(kubeconfig)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
    assert {r.method for r in fake.requests()} == {"GET", "PATCH", "POST"}
