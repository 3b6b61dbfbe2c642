"""Synchronize: the runtime's list of existing pods and containers, taken chunk by chunk.

Each chunk is converted at once into the compact views the node state keeps (never held as raw
messages), a few hundred objects between two turns of the event loop. The whole Synchronize is
refused when it lists more than the configured limits; otherwise its last chunk replaces the
node state and runs every capability's ``synchronize`` in a worker thread, under what the earlier
chunks left of the one request timeout the runtime gives the whole Synchronize.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from common.audit import AuditLog
from common.metrics import PluginMetrics
from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo, ReadKeys
from hooks.untrusted import bounded
from nri_plugin.config.schema import Config, PluginConfig
from nri_plugin.session.capability import Capability
from nri_plugin.session.chain import bind, run_threaded
from nri_plugin.session.event_log import METRIC_RESULT, EventLog
from nri_plugin.session.failure import FailurePolicy
from nri_plugin.session.terms import MIN_DEADLINE_MS, SessionTerms
from nri_plugin.session.workload_records import record_ignored
from nri_plugin.wire.convert import ConvertedPod, container_info, convert_pod
from nri_plugin.wire.errors import MessageError, RpcError
from nri_plugin.wire.messages import parse_message
from nri_plugin.wire.rejections import Rejection
from nri_plugin.wire.status import StatusCode
from protos import nri_api_pb2 as api

SYNC_BATCH = 256
"""Pods or containers of a Synchronize chunk converted between two turns of the event loop, so a
large chunk never holds up the other requests for long."""

Reject = Callable[[Rejection, str], None]
"""Counts (and logs) a refusal on the connection: its kind and what was refused."""


@dataclass(slots=True)
class SyncProgress:
    """A Synchronize whose chunks are arriving: what they held, already converted."""

    started: float
    pods: list[PodInfo] = dataclasses.field(default_factory=list)
    containers: list[ContainerInfo] = dataclasses.field(default_factory=list)
    # Ids of the containers listed as stopped (exited, not removed yet).
    stopped: set[str] = dataclasses.field(default_factory=set)
    listed_pods: int = 0
    listed_containers: int = 0
    wire_bytes: int = 0
    refused_objects: int = 0
    first_refusal: str = ""
    # Pods kept without their annotations and labels (too large), and the first of them.
    ignored_pods: int = 0
    first_ignored: ConvertedPod | None = None
    # Why the Synchronize is over its limits (its content is then no longer converted).
    over: str | None = None


class Synchronizer:
    """Takes the chunks of one Synchronize after another, and applies each whole Synchronize.

    Always fail-open, strict or not: Synchronize vetoes nothing, and an error would only get the
    plugin dropped, reconnect, and fail the same way again.
    """

    def __init__(
        self,
        *,
        config: Callable[[], Config],
        capabilities: Sequence[Capability],
        state: NodeState,
        audit: AuditLog,
        executor: Executor,
        metrics: PluginMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._capabilities = tuple(capabilities)
        self._state = state
        self._audit = audit
        self._executor = executor
        self._event_log = EventLog(config, metrics, clock)
        self._clock = clock
        self._policy = FailurePolicy(audit, strict=False)
        # The Synchronize in progress; its chunks share one request timeout on the runtime's
        # side, counted from the first one.
        self._progress: SyncProgress | None = None

    @property
    def in_progress(self) -> bool:
        """Whether a chunk arrived and the last one did not yet."""
        return self._progress is not None

    def reset(self) -> None:
        """Forget a Synchronize left unfinished (its connection ended)."""
        self._progress = None

    async def take(self, payload: bytes, terms: SessionTerms, reject: Reject) -> bool:
        """Take one chunk; whether more follow. A payload that does not decode is refused
        (``INVALID_ARGUMENT``) and ends the Synchronize; the last chunk applies it."""
        sync = self._progress
        if sync is None:
            sync = self._progress = SyncProgress(self._clock())
        sync.wire_bytes += len(payload)
        req = parse_message(api.SynchronizeRequest, payload)
        del payload
        if req is None:
            self._progress = None
            reject(Rejection.BAD_PAYLOAD, "SynchronizeRequest payload does not decode")
            raise RpcError(StatusCode.INVALID_ARGUMENT, "Synchronize payload does not decode")
        more = req.more
        sync.listed_pods += len(req.pods)
        sync.listed_containers += len(req.containers)
        cfg = self._config()
        if sync.over is None:
            sync.over = _over_limit(sync, cfg.plugin)
        if sync.over is None:
            # Converted now, chunk by chunk: only the compact views are kept until the last one.
            await self._take_chunk(sync, req, cfg.read_keys())
        del req
        if more:
            # Updates wait for the last chunk; every earlier one is answered with more = true.
            return True
        self._progress = None
        if sync.over is not None:
            self._refuse(sync.over, reject)
        else:
            await self._apply(sync, terms)
        return False

    async def _take_chunk(self, sync: SyncProgress, req: api.SynchronizeRequest,
                          keys: ReadKeys) -> None:
        done = 0
        for pod_msg in req.pods:
            try:
                converted = convert_pod(pod_msg, keys)
            except MessageError as exc:
                _note_refusal(sync, f"pod {bounded(pod_msg.uid)}: {exc}")
            else:
                sync.pods.append(converted.info)
                if converted.ignored:
                    sync.ignored_pods += 1
                    sync.first_ignored = sync.first_ignored or converted
            done += 1
            if done % SYNC_BATCH == 0:
                await asyncio.sleep(0)
        for container_msg in req.containers:
            try:
                info = container_info(container_msg)
            except MessageError as exc:
                _note_refusal(sync, f"container {bounded(container_msg.name)}: {exc}")
            else:
                sync.containers.append(info)
                if container_msg.state == api.CONTAINER_STOPPED:
                    sync.stopped.add(info.id)
            done += 1
            if done % SYNC_BATCH == 0:
                await asyncio.sleep(0)

    def _refuse(self, over: str, reject: Reject) -> None:
        """Take nothing from a Synchronize over the limits: the node state keeps what it knew,
        events go on being served, and the audit trail says why."""
        reject(Rejection.SYNCHRONIZE_OVER_LIMIT, over)
        self._audit.record("event_failed", nri_event="synchronize", pod_uid="", container="",
                           reason=f"Synchronize refused: {over}; the pods and containers known "
                                  "so far stay in use")
        self._event_log.line().info("nri_event", nri_event="synchronize", result="invalid",
                                    refused=over)

    async def _apply(self, sync: SyncProgress, terms: SessionTerms) -> None:
        spent_ms = (self._clock() - sync.started) * 1000
        started = self._clock()
        result = "ok"
        pods, containers = sync.pods, sync.containers
        if sync.refused_objects:
            # One record for all of them: a runtime listing thousands of unusable objects must
            # not write thousands of lines.
            result = "invalid"
            self._policy.invalid_input("synchronize", MessageError(
                f"{sync.refused_objects} pods or containers refused, the first: "
                f"{sync.first_refusal}"))
        if sync.first_ignored is not None:
            # One record for all of them, as for the refused objects.
            record_ignored(self._audit, sync.first_ignored, others=sync.ignored_pods - 1)
        self._state.replace_all(pods, containers, stopped=sync.stopped)
        if self._capabilities:
            calls = [(c.name, bind(c.synchronize, tuple(pods), tuple(containers)))
                     for c in self._capabilities]
            deadline_ms = terms.deadline_ms(self._config().plugin)
            budget_ms = max(MIN_DEADLINE_MS, deadline_ms - spent_ms)
            chain = await run_threaded(calls, self._executor, budget_ms)
            self._policy.chain("synchronize", chain, pod_uid="", container="")
            if not chain.complete:
                result = "partial"
        seconds = self._clock() - started
        self._event_log.line().info("nri_event", nri_event="synchronize", pods=len(pods),
                                    containers=len(containers), result=result,
                                    duration_ms=round(seconds * 1000, 3))
        self._event_log.count("synchronize", METRIC_RESULT[result], seconds)


def _over_limit(sync: SyncProgress, limits: PluginConfig) -> str | None:
    """Why the Synchronize received so far is over the configured limits, or None."""
    if sync.listed_pods > limits.max_sync_pods:
        return f"{sync.listed_pods} pods, more than plugin.max_sync_pods = {limits.max_sync_pods}"
    if sync.listed_containers > limits.max_sync_containers:
        return (f"{sync.listed_containers} containers, more than plugin.max_sync_containers = "
                f"{limits.max_sync_containers}")
    if sync.wire_bytes > limits.max_sync_bytes:
        return (f"{sync.wire_bytes} bytes, more than plugin.max_sync_bytes = "
                f"{limits.max_sync_bytes}")
    return None


def _note_refusal(sync: SyncProgress, error: str) -> None:
    sync.refused_objects += 1
    if not sync.first_refusal:
        sync.first_refusal = error
