"""A memory value an annotation set through the API server goes when the annotation goes: the
real kubernetes client watches a server that behaves like the API server, and drift writes the
container's memory.high, then gives it back."""

from __future__ import annotations

import json
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.memory_qos import VOLCANO_ANNOTATION
from reconciler.host.sysfs import SysFs
from tests.support.fake_apiserver import FakeApiServer, make_pod
from tests.support.fakesys import MIB
from tests.support.pod_watch import annotate, reconciling, web_0, woken_by_the_watch_only
from tests.support.polling import eventually

UID = "77777777-0000-0000-0000-000000000007"


async def test_memory_high_from_an_annotation_goes_when_the_api_removes_it(
        tmp_path: Path) -> None:
    host, container = web_0(tmp_path / "host", UID)
    state = NodeState()
    state.replace_all(*host.nri())
    audit = AuditLog(MemoryAuditSink())
    sysfs = SysFs(host.root, audit)

    def memory_high() -> str:
        return (host.cg("", container.rel) / "memory.high").read_text().strip()

    with FakeApiServer() as server:
        server.add_pod(make_pod("web-0", uid=UID, node="node-a",
                                memory={"c0": ("256Mi", "512Mi")}))
        async with reconciling(tmp_path, server, woken_by_the_watch_only(), state, sysfs, audit):
            await eventually(
                lambda: state.snapshot().containers[0].info.memory_request == 256 * MIB)
            assert memory_high() == "max"
            server.modify_pod("default", "web-0", annotate(
                VOLCANO_ANNOTATION, json.dumps({"memoryQos": {"highRatio": 50}})))
            await eventually(lambda: memory_high() == str(256 * MIB))
            server.modify_pod("default", "web-0", annotate(VOLCANO_ANNOTATION, None))
            await eventually(lambda: memory_high() == "max")
