"""Which task is serving an NRI request, so that calls that must not come from one can refuse.

The runtime holds its lock while it waits for a handler's answer: a handler that awaited a call
to the runtime (``UpdateContainers``) could only time out. Handlers wrapped by :func:`guarded`
mark the task that finishes them; :func:`in_handler` tells whether the current task is one.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable

from nri_plugin.wire.transport import Handler
from protos import ttrpc_envelope_pb2 as envelope

_in_handler: contextvars.ContextVar[bool] = contextvars.ContextVar("_in_handler", default=False)


def in_handler() -> bool:
    """Whether the current task is finishing an NRI request."""
    return _in_handler.get()


def guarded(handler: Handler) -> Handler:
    """``handler``, with the task that finishes a waiting answer marked."""

    def run(request: envelope.Request) -> bytes | Awaitable[bytes]:
        result = handler(request)
        # An answer given at once came from code that cannot wait, so it cannot have awaited
        # update_containers either.
        return result if isinstance(result, bytes) else _marked(result)

    return run


async def _marked(pending: Awaitable[bytes]) -> bytes:
    # Each waiting request runs in its own task, hence its own context: this marks only this one.
    _in_handler.set(True)
    return await pending
