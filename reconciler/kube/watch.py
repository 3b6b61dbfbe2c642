"""This node's pods: one list, then a watch from its resourceVersion, again after every break.

A watch that reports 410 (Gone: its resourceVersion is too old, at the start or as an ERROR
event in the stream) is followed by a fresh list; pods the list no longer has are reported
deleted. So is, after a backoff, a malformed event (a line that is not JSON, an event that is
not one, an ERROR event of another code): a watch resumed from the last event seen would get
the same event back from the server, again and again. Everything else that ends a watch early
(an HTTP error, a dropped connection, a stream cut inside an event) is retried from the last
event seen, after a backoff.

Why not ``kubernetes.watch.Watch``: it reads the same stream, but (kubernetes 37, shown by
``tests/test_watch_library.py``) it drops a stream's unterminated last line without a word,
yields ``None`` for a line that is not JSON, and raises ``KeyError`` for an ERROR event without
a ``code``; here each of those is a broken watch, retried from the last event (the cut-off
line) or relisted past (the other two). It also
deserializes every pod into the client's models before yielding it: for a 3.7 kB pod 320 us
against 62 us for the JSON parse and :func:`~common.podmeta.pod_meta_from_object` together;
with deserializing turned off it no longer tracks the resume point. What it adds (one silent
retry after a 410 when no server timeout is set; with one, as here, it raises as this module
does) the relist here already covers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import structlog

from common import jsondoc
from common.aio import Backoff, done_or_stopped, sleep_until
from common.podmeta import PodMeta, pod_meta_from_object
from reconciler.kube.client import read_json, resource_version
from reconciler.kube.config import KubernetesConfig
from reconciler.kube.errors import HTTP_GONE, TRANSIENT, ApiError, describe
from reconciler.kube.rest import Rest
from reconciler.kube.threads import ApiThreads
from reconciler.kube.transport import Api

log = structlog.get_logger("nri_qos.kube")

_T = TypeVar("_T")

PODS = "/api/v1/pods"
"""Every namespace's pods; the watch asks for this node's by a field selector."""
# A watch that ends sooner than this without any event counts as a failure (backoff), so a
# server that keeps closing streams at once cannot make the watcher spin.
MIN_HEALTHY_WATCH_S = 1.0


class _Stopped(Exception):
    """The stop event was set while a request was in flight."""


class _Gone(Exception):
    """The watch's resourceVersion is too old (410); only a fresh list can continue. ``events``:
    how many the watch had delivered before."""

    def __init__(self, events: int = 0) -> None:
        super().__init__(events)
        self.events = events


class _Malformed(Exception):
    """A watch event could not be read; a fresh list continues past it, after a backoff."""


class LineReader:
    """Splits a streaming (chunked) HTTP response into JSON lines; used from one worker thread."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self._chunks = response.stream(amt=None, decode_content=True)
        self._buffer = b""

    def read_lines(self) -> list[bytes]:
        """The complete lines that arrive next; an empty list means the stream ended."""
        while True:
            lines = self._buffer.split(b"\n")
            self._buffer = lines.pop()
            complete = [line for line in lines if line.strip()]
            if complete:
                return complete
            chunk = next(self._chunks, None)
            if chunk is None:
                if self._buffer.strip():
                    raise ValueError("watch stream ended inside an event")
                return []
            self._buffer += chunk

    def interrupt(self) -> None:
        """Unblocks a read in progress in another thread (urllib3 >= 2.3), else closes."""
        shutdown = getattr(self._response, "shutdown", None)
        try:
            if shutdown is not None:
                shutdown()
            else:
                self._response.close()
        except (ValueError, RuntimeError, OSError):
            pass

    def close(self) -> None:
        self._response.close()
        self._response.release_conn()


class _Handoff(Generic[_T]):
    """Hands a worker thread's result to the loop, or to ``discard`` once nobody waits for it.

    The release happens in whichever side comes second, under a lock, so it happens exactly
    once and does not need the event loop: a loop that stops before a late result reaches it
    would otherwise leave that result's connection open.
    """

    def __init__(self, discard: Callable[[_T], None] | None) -> None:
        self._discard = discard
        self._lock = threading.Lock()
        self._abandoned = False
        self._delivered: list[_T] = []

    def deliver(self, result: _T) -> _T:
        """Called in the worker thread with ``fn``'s result."""
        with self._lock:
            late = self._abandoned
            if not late:
                self._delivered.append(result)
        if late and self._discard is not None:
            self._discard(result)
        return result

    def abandon(self) -> None:
        """Called on the loop when the caller gives up on the result."""
        with self._lock:
            self._abandoned = True
            delivered, self._delivered = self._delivered, []
        if self._discard is not None:
            for result in delivered:
                self._discard(result)


def _taken(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class PodWatcher:
    """Lists this node's pods, then watches them, and reports each change as a :class:`PodMeta`.

    ``on_event`` runs on the event loop, in API order. Deleted pods are reported with
    ``deleted=True``, also those found missing when a relist follows a broken watch.
    """

    def __init__(
        self,
        api: Api | None,
        cfg: KubernetesConfig,
        node: str,
        *,
        initial_backoff_s: float = 0.5,
    ) -> None:
        self._api = api
        self._cfg = cfg
        self._node = node
        self._selector = f"spec.nodeName={node}"
        self._initial_backoff_s = initial_backoff_s
        self._known: dict[str, PodMeta] = {}
        self._stream: LineReader | None = None
        # resourceVersion to watch from: set by a list, advanced by every event; None = relist
        self._resume_from: str | None = None

    def known(self) -> tuple[PodMeta, ...]:
        """Every pod the watch knows now, whole (on the event loop's thread, as the watch)."""
        return tuple(self._known.values())

    async def run(self, on_event: Callable[[PodMeta], None], stop: asyncio.Event) -> None:
        if self._api is None:
            log.warning("pod_watch_off", detail="no Kubernetes API; pod metadata from NRI only")
            await stop.wait()
            return
        rest = Rest(self._api)
        # One thread: the list and the stream's reads follow each other.
        threads = ApiThreads(f"pod-watch-{self._node}", 1)
        backoff = Backoff(self._initial_backoff_s, self._cfg.retry_max_s)
        loop = asyncio.get_running_loop()
        self._resume_from = None
        try:
            while not stop.is_set():
                started = loop.time()
                relisting = self._resume_from is None
                try:
                    if relisting:
                        await self._list(rest, on_event, threads, stop)
                    events = await self._watch(rest, on_event, threads, stop)
                    if events or loop.time() - started >= MIN_HEALTHY_WATCH_S:
                        backoff.reset()
                        continue
                    reason = "watch ended at once"
                except _Stopped:
                    return
                except _Gone as gone:
                    self._resume_from = None
                    if gone.events:
                        # It delivered events first: a watch that went well, not one that
                        # expired at its start.
                        backoff.reset()
                    if not relisting or gone.events:
                        log.info("pod_watch_expired", node=self._node, detail="relisting")
                        continue
                    # Expired straight after a fresh list: the server is unwell; do not spin.
                    reason = "watch expired right after a list"
                except _Malformed as exc:
                    self._resume_from = None
                    reason = f"malformed watch event, relisting: {exc}"
                except TRANSIENT as exc:
                    reason = describe(exc)
                delay = backoff.next()
                log.warning("pod_watch_retry", node=self._node, reason=reason, delay_s=delay)
                await sleep_until(delay, stop)
        finally:
            threads.close()

    async def _call(
        self,
        fn: Callable[[], _T],
        threads: ApiThreads,
        stop: asyncio.Event,
        discard: Callable[[_T], None] | None = None,
    ) -> _T:
        """Runs ``fn`` in the worker thread; on stop, interrupts an open stream and gives up.

        The abandoned call ends on its own (interrupted, or at its request timeout); ``discard``
        then releases what it returns.
        """
        handoff = _Handoff(discard)
        work = threads.run(lambda: handoff.deliver(fn()))
        try:
            done = await done_or_stopped(work, stop)
        except asyncio.CancelledError:
            self._abandon(handoff, work)
            raise
        if done:
            return work.result()
        self._abandon(handoff, work)
        raise _Stopped

    def _abandon(self, handoff: _Handoff[Any], work: asyncio.Future[Any]) -> None:
        stream = self._stream
        if stream is not None:
            stream.interrupt()
        handoff.abandon()
        # The interrupted read fails ("Response ended prematurely"): the stop's doing, and
        # nobody waits for it any more; taken here, it is not logged as an error at exit.
        work.add_done_callback(_taken)

    async def _list(
        self,
        rest: Rest,
        on_event: Callable[[PodMeta], None],
        threads: ApiThreads,
        stop: asyncio.Event,
    ) -> None:
        def fetch() -> Any:
            return read_json(rest.request("GET", PODS, query=[("fieldSelector", self._selector)],
                                          timeout=self._cfg.request_timeout_s))

        body = await self._call(fetch, threads, stop)
        if not isinstance(body, dict):
            raise ValueError("pod list is not a JSON object")
        listed_version = resource_version(body)
        if not listed_version:
            raise ValueError("pod list has no metadata.resourceVersion")
        # null (or absent) is how Go writes an empty list; anything else that is not a list of
        # objects is refused: read as no pods, it would report every known pod deleted.
        items = body.get("items")
        items = [] if items is None else items
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise ValueError("pod list items are not a list of objects")
        listed = [pod_meta_from_object(item) for item in items]
        present = {meta.uid for meta in listed}
        for uid in [uid for uid in self._known if uid not in present]:
            _emit(on_event, dataclasses.replace(self._known.pop(uid), deleted=True))
        for meta in listed:
            if self._known.get(meta.uid) != meta:
                self._known[meta.uid] = meta
                _emit(on_event, meta)
        log.info("pod_list", node=self._node, pods=len(listed), resource_version=listed_version)
        self._resume_from = listed_version

    async def _watch(
        self,
        rest: Rest,
        on_event: Callable[[PodMeta], None],
        threads: ApiThreads,
        stop: asyncio.Event,
    ) -> int:
        """Follows one watch stream from ``_resume_from``; returns the number of events."""

        def open_stream() -> LineReader:
            query: list[tuple[str, str | int | bool]] = [
                ("fieldSelector", self._selector), ("watch", True),
                ("allowWatchBookmarks", True), ("timeoutSeconds", self._cfg.watch_timeout_s)]
            if self._resume_from is not None:
                query.append(("resourceVersion", self._resume_from))
            response = rest.request(
                "GET", PODS, query=query,
                # The read timeout catches a silently dead connection: the server writes at
                # least the end of the stream when its own timeout expires.
                timeout=(
                    self._cfg.request_timeout_s,
                    self._cfg.watch_timeout_s + self._cfg.request_timeout_s,
                ),
            )
            return LineReader(response)

        try:
            stream = await self._call(
                open_stream, threads, stop, discard=lambda late: late.close()
            )
        except ApiError as exc:
            if exc.status == HTTP_GONE:
                raise _Gone from exc
            raise
        self._stream = stream
        events = 0
        try:
            while True:
                lines = await self._call(stream.read_lines, threads, stop)
                if not lines:
                    return events
                for line in lines:
                    try:
                        self._apply(jsondoc.loads(line), on_event)
                    except ValueError as exc:
                        raise _Malformed(describe(exc)) from exc
                    except _Gone:
                        raise _Gone(events) from None
                    events += 1
        finally:
            self._stream = None
            threads.submit(stream.close)

    def _apply(self, event: Any, on_event: Callable[[PodMeta], None]) -> None:
        """Handles one watch event and moves the resume point past it."""
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            raise ValueError("watch event is not an object with an 'object' field")
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            if obj.get("code") == HTTP_GONE:
                raise _Gone
            raise ValueError(f"watch error {obj.get('code')}: {obj.get('message', '')}")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            meta = pod_meta_from_object(obj, deleted=kind == "DELETED")
            if meta.deleted:
                self._known.pop(meta.uid, None)
            else:
                self._known[meta.uid] = meta
            _emit(on_event, meta)
        # BOOKMARK (and any future type) only moves the resume point forward.
        self._resume_from = resource_version(obj) or self._resume_from


def _emit(on_event: Callable[[PodMeta], None], meta: PodMeta) -> None:
    """Hands one pod to the consumer; a failing consumer must not end or rewind the watch."""
    try:
        on_event(meta)
    except Exception:
        log.exception("pod_event_failed", pod=f"{meta.namespace}/{meta.name}", uid=meta.uid)
