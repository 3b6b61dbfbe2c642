"""One out-of-tree eviction plugin: its gRPC channel and calls (the rest of the remote plugins'
story, the directory and the trust in a socket, is :mod:`reconciler.eviction.remote`'s, which
loads this module with the first plugin it finds)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from hooks.untrusted import bounded
from protos import eviction_pb2 as pb
from protos import eviction_pb2_grpc as pb_grpc
from reconciler.eviction.api import ActivePod, EvictPods, ThresholdMet, TopPods
from reconciler.eviction.remote import (
    MAX_MESSAGE_BYTES,
    PluginCallError,
    check_socket,
    evict_pods_from,
    invalid,
    pod_message,
    threshold_from,
    top_pods_from,
)

M = TypeVar("M")

# A restarted plugin is found again within a few seconds, not after gRPC's default 2 minutes.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
)


def _error_kind(exc: grpc.aio.AioRpcError) -> PluginCallError:
    code = exc.code()
    details = bounded(exc.details() or "")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return PluginCallError("deadline", details or "deadline exceeded")
    if code is grpc.StatusCode.UNAVAILABLE:
        return PluginCallError("unavailable", details or "unavailable")
    # The client could not decode the answer.
    if code is grpc.StatusCode.INTERNAL and "deserializ" in details.lower():
        return invalid(details)
    return PluginCallError("error", f"{code.name}: {details}")


class RemotePlugin:
    """One out-of-tree plugin; :mod:`reconciler.eviction.remote` says what is checked.
    ``identity``: the socket's as listed."""

    def __init__(self, name: str, path: str, deadline: Callable[[], float],
                 identity: tuple[int, int, int] | None = None) -> None:
        self._name = name
        self.path = path
        self._identity = identity
        self._deadline = deadline
        self._channel = grpc.aio.insecure_channel(f"unix:{path}", options=CHANNEL_OPTIONS)
        self._stub: Any = pb_grpc.EvictionPluginStub(self._channel)  # type: ignore[no-untyped-call]

    @property
    def name(self) -> str:
        return self._name

    async def _call(self, method: str, request: Any, answer: type[M]) -> M:
        if self._identity is not None:
            check_socket(self.path, self._identity)
        try:
            found = await getattr(self._stub, method)(request, timeout=self._deadline())
        except grpc.aio.AioRpcError as exc:
            raise _error_kind(exc) from None
        # grpc.aio hands over None when the bytes did not decode.
        if not isinstance(found, answer):
            raise invalid(f"the answer is not a {answer.__name__}")
        return found

    async def threshold_met(self) -> ThresholdMet:
        return threshold_from(await self._call("ThresholdMet", pb.ThresholdMetRequest(),
                                               pb.ThresholdMetResponse))

    async def get_top_eviction_pods(self, active: Sequence[ActivePod], top_n: int,
                                    scope: str) -> TopPods:
        request = pb.GetTopEvictionPodsRequest(
            active_pods=[pod_message(p) for p in active], top_n=top_n, eviction_scope=scope)
        return top_pods_from(await self._call("GetTopEvictionPods", request,
                                              pb.GetTopEvictionPodsResponse), top_n)

    async def get_evict_pods(self, active: Sequence[ActivePod]) -> EvictPods:
        request = pb.GetEvictPodsRequest(active_pods=[pod_message(p) for p in active])
        return evict_pods_from(await self._call("GetEvictPods", request,
                                                pb.GetEvictPodsResponse))

    async def close(self) -> None:
        await self._channel.close(grace=None)
