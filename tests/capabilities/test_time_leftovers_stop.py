"""An agent started with the reconciler off, taking off the taint an earlier run left, is stopped
while the API server does not answer: the stop does not wait for the request timeouts (each
read of the node tried again by the client, one node write per condition) of a release that can
only be finished by the next start. The agent as the daemon builds it, on a fake host, against
the fake API server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nri_plugin.agent import LEFTOVERS_STOP_WAIT_S
from reconciler.host.statefile import state_file
from reconciler.mitigation.actions import TAINT_NOTES
from tests.support.fake_apiserver import FakeApiServer
from tests.support.held_up import stop_while_node_reads_are_held_up
from tests.support.reconciler_off_agent import agent_with_the_reconciler_off

NODE = "node-a"
KEY = "nri-qos.io/memory-pressure"
REQUEST_TIMEOUT_S = 10.0
"""The shipped ``kubernetes.request_timeout_s``."""
STOP_S = LEFTOVERS_STOP_WAIT_S + 2.0
"""A stop's bound here: well below one request timeout."""


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


async def test_a_stop_does_not_wait_for_a_release_the_api_server_holds_up(
        tmp_path: Path, fake: FakeApiServer) -> None:
    fake.add_node(NODE, taints=[{"key": KEY, "value": "", "effect": "NoSchedule"}])
    state_file(str(tmp_path / "state")).put(TAINT_NOTES, KEY, "NoSchedule")
    agent = agent_with_the_reconciler_off(tmp_path, fake, NODE,
                                          request_timeout_s=REQUEST_TIMEOUT_S)
    (leftovers,) = agent.services[1:]
    try:
        await stop_while_node_reads_are_held_up(leftovers, fake, NODE,
                                                hold_s=6 * REQUEST_TIMEOUT_S, stop_s=STOP_S)
    finally:
        agent.executor.shutdown()
    # Not released: the note stays for the next start (or nri-qos reset).
    assert state_file(str(tmp_path / "state")).entries(TAINT_NOTES) == {KEY: "NoSchedule"}
    assert [t["key"] for t in fake.taints(NODE)] == [KEY]
