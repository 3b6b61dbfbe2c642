"""An out-of-tree eviction plugin for the tests:
``python -m tests.support.eviction_plugin SOCKET MODE``.

It serves the gRPC API of ``protos/eviction.proto`` on a unix socket, created beside the final
name and renamed into place once the server listens (the manager never sees a socket nobody
answers on), then prints ``ready``. Modes:

* ``normal``: ``--met`` says what ThresholdMet answers (with ``--condition NAME``), ``--evict
  UID`` (repeatable; ``UID:force`` for a forced one) what GetEvictPods proposes;
  GetTopEvictionPods names the reclaimed_cores pods, largest memory first. ``--record FILE``
  appends every request as a JSON line.
* ``hang``: every call waits forever.
* ``crash``: ThresholdMet answers; the process dies in the middle of GetEvictPods, which the
  manager asks at the same time: the death waits until ThresholdMet's answer has had
  ``CRASH_AFTER_S`` to leave, so that it is only GetEvictPods that finds the plugin gone.
* ``garbage``: ThresholdMet answers bytes that are no protobuf message; GetEvictPods a pod
  without uid; GetTopEvictionPods more pods than asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

import grpc
import grpc.aio
from google.protobuf.json_format import MessageToDict

from protos import eviction_pb2 as pb
from protos import eviction_pb2_grpc as pb_grpc

SERVICE = "nriqos.eviction.v1.EvictionPlugin"
MET = {"none": pb.NOT_MET, "soft": pb.SOFT_MET, "hard": pb.HARD_MET}
CRASH_AFTER_S = 0.15


class Plugin(pb_grpc.EvictionPluginServicer):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.answered = asyncio.Event()

    def _record(self, call: str, request: Any) -> None:
        if self.args.record:
            with open(self.args.record, "a", encoding="utf-8") as out:
                out.write(json.dumps({"call": call, "request": MessageToDict(
                    request, preserving_proto_field_name=True)}) + "\n")

    async def _hang_or_crash(self, call: str) -> None:
        if self.args.mode == "hang":
            await asyncio.sleep(3600)
        if self.args.mode == "crash" and call == "GetEvictPods":
            await self.answered.wait()
            await asyncio.sleep(CRASH_AFTER_S)
            os._exit(3)

    async def ThresholdMet(self, request: Any, context: Any) -> pb.ThresholdMetResponse:
        self._record("ThresholdMet", request)
        await self._hang_or_crash("ThresholdMet")
        answer = pb.ThresholdMetResponse(
            threshold_value=0.5, observed_value=0.9, threshold_operator=pb.GREATER_THAN,
            met_type=MET[self.args.met], eviction_scope="example")
        if self.args.condition:
            answer.condition.CopyFrom(pb.Condition(
                type=pb.NODE_CONDITION, name=self.args.condition,
                met=self.args.met != "none"))
        self.answered.set()
        return answer

    async def GetTopEvictionPods(self, request: Any, context: Any) -> Any:
        self._record("GetTopEvictionPods", request)
        await self._hang_or_crash("GetTopEvictionPods")
        pods = sorted((p for p in request.active_pods if p.qos_level == pb.RECLAIMED_CORES),
                      key=lambda p: -p.memory_usage_bytes)
        answer = pb.GetTopEvictionPodsResponse(
            target_pod_uids=[p.uid for p in pods[:request.top_n]])
        answer.grace_period_seconds = 7
        return answer

    async def GetEvictPods(self, request: Any, context: Any) -> pb.GetEvictPodsResponse:
        self._record("GetEvictPods", request)
        await self._hang_or_crash("GetEvictPods")
        pods = []
        for item in self.args.evict:
            uid, _, force = item.partition(":")
            pods.append(pb.EvictPod(uid=uid, reason="example says so", force=force == "force"))
        return pb.GetEvictPodsResponse(evict_pods=pods)


def _garbage_handler() -> grpc.GenericRpcHandler:
    async def threshold(request: Any, context: Any) -> bytes:
        return b"\xff\xff\xff\xff not a message"

    async def evict(request: Any, context: Any) -> pb.GetEvictPodsResponse:
        return pb.GetEvictPodsResponse(evict_pods=[pb.EvictPod(uid="", reason="?")])

    async def top(request: Any, context: Any) -> pb.GetTopEvictionPodsResponse:
        return pb.GetTopEvictionPodsResponse(
            target_pod_uids=["x"] * (request.top_n + 5))

    def raw(value: bytes) -> bytes:
        return value

    return grpc.method_handlers_generic_handler(SERVICE, {
        "ThresholdMet": grpc.unary_unary_rpc_method_handler(
            threshold, request_deserializer=pb.ThresholdMetRequest.FromString,
            response_serializer=raw),
        "GetEvictPods": grpc.unary_unary_rpc_method_handler(
            evict, request_deserializer=pb.GetEvictPodsRequest.FromString,
            response_serializer=pb.GetEvictPodsResponse.SerializeToString),
        "GetTopEvictionPods": grpc.unary_unary_rpc_method_handler(
            top, request_deserializer=pb.GetTopEvictionPodsRequest.FromString,
            response_serializer=pb.GetTopEvictionPodsResponse.SerializeToString),
    })


async def serve(args: argparse.Namespace) -> None:
    server = grpc.aio.server()
    if args.mode == "garbage":
        server.add_generic_rpc_handlers((_garbage_handler(),))
    else:
        pb_grpc.add_EvictionPluginServicer_to_server(Plugin(args), server)  # type: ignore[no-untyped-call]
    staging = os.path.join(os.path.dirname(args.socket), f".{os.getpid()}.staging")
    server.add_insecure_port(f"unix:{staging}")
    await server.start()
    os.rename(staging, args.socket)
    print("ready", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("mode", choices=("normal", "hang", "crash", "garbage"))
    parser.add_argument("--met", choices=tuple(MET), default="none")
    parser.add_argument("--condition", default="")
    parser.add_argument("--evict", action="append", default=[])
    parser.add_argument("--record", default="")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
