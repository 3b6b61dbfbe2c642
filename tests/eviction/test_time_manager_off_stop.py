"""An eviction manager switched off takes its conditions off the node; stopped while the API
server holds those writes up, it ends within a bound instead of waiting for the request
timeouts of every condition in turn (its notes stay for the next start)."""

from __future__ import annotations

from pathlib import Path

from reconciler.eviction.builtin import IN_TREE_CONDITIONS
from reconciler.eviction.manager import WITHDRAW_STOP_WAIT_S
from reconciler.host.statefile import state_file
from tests.support.eviction_env import NODE, make_env
from tests.support.fake_apiserver import FakeApiServer
from tests.support.held_up import stop_while_node_reads_are_held_up

REQUEST_TIMEOUT_S = 10.0
"""The shipped ``kubernetes.request_timeout_s``."""
STOP_S = WITHDRAW_STOP_WAIT_S + 2.0
"""A stop's bound here: well below one request timeout."""


async def test_a_stop_does_not_wait_for_withdrawals_the_api_server_holds_up(
        tmp_path: Path, fake: FakeApiServer) -> None:
    fake.set_conditions(NODE, [{"type": "Ready", "status": "True"},
                               {"type": IN_TREE_CONDITIONS[0], "status": "True"}])
    env = make_env(tmp_path, fake, request_timeout_s=REQUEST_TIMEOUT_S,
                   notes=state_file(str(tmp_path / "state")), enabled=False)
    await stop_while_node_reads_are_held_up(env.manager.run, fake, NODE,
                                            hold_s=6 * REQUEST_TIMEOUT_S, stop_s=STOP_S)
    assert IN_TREE_CONDITIONS[0] in fake.condition_types(NODE)
