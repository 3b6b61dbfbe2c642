"""One connection's handshake: RegisterPlugin, then Configure, then each chunk of Synchronize.

Every step has a deadline, the runtime's registration timeout (the configured one until
Configure states the runtime's own): a runtime that stalls there (restarting, behind a stalled
proxy) would otherwise leave the plugin connected and never serving. The connection is then
closed, which goes back to connecting, with the usual backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

import structlog

from common.aio import wait_for_event
from hooks.untrusted import bounded
from nri_plugin.wire.errors import ConnectionClosed, RpcError
from nri_plugin.wire.nri_api import RUNTIME_SERVICE
from nri_plugin.wire.rejections import Rejection
from nri_plugin.wire.transport import TtrpcPeer
from protos import nri_api_pb2 as api

PLUGIN_NRI_VERSION = "v0.12.2"
"""The NRI schema this plugin is built on, announced in RegisterPlugin."""

log = structlog.get_logger("nri_qos.nri")


class Handshake:
    """Where one connection's handshake stands, and its watchdog.

    The session marks each step: :attr:`configured` and :meth:`step` at Configure,
    :meth:`answering` around each Synchronize chunk, :attr:`synchronized` after the last one.
    """

    def __init__(self, registration_timeout_ms: int) -> None:
        self.registration_timeout_ms = registration_timeout_ms
        """The deadline of each step; Configure replaces it with the runtime's own."""
        self.configured = False
        self.synchronized = asyncio.Event()
        self._registered = asyncio.Event()
        # Set at every step of the handshake (Configure, each Synchronize chunk).
        self._progress = asyncio.Event()
        # Steps the plugin is still working on (the runtime waits for their answers).
        self._answering = 0

    def step(self) -> None:
        """The runtime took a step: the next one gets a fresh deadline."""
        self._progress.set()

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """A step the plugin works on: no deadline runs until it is answered, since the runtime
        waits for the plugin meanwhile (under its own request timeout); the next step's
        deadline starts with the answer."""
        self._answering += 1
        self.step()
        try:
            yield
        finally:
            self._answering -= 1
            self.step()

    async def register(self, peer: TtrpcPeer, name: str, index: str, timeout_s: float) -> None:
        """Send RegisterPlugin; a runtime that refuses it ends the connection."""
        request = api.RegisterPluginRequest(plugin_name=name, plugin_idx=index,
                                            NRI_version=PLUGIN_NRI_VERSION)
        full_name = f"{index}-{name}"
        try:
            await peer.call(RUNTIME_SERVICE, "RegisterPlugin", request.SerializeToString(),
                            timeout_s=timeout_s)
        except RpcError as exc:
            # The runtime's words are logged once, here; the reason the connection ended (which
            # is logged too) only points to them.
            log.error("registration_failed", plugin=full_name,
                      error=bounded(exc.message, 512), code=exc.code)
            peer.close(f"registration failed with code {exc.code} (see registration_failed)")
        except ConnectionClosed:
            return
        else:
            log.info("registered", plugin=full_name)
            self._registered.set()

    async def watch(self, peer: TtrpcPeer, syncing: Callable[[], bool],
                    reject: Callable[[Rejection, str], None]) -> None:
        """Close the connection when the runtime does not take the next step within the
        registration timeout: Configure after RegisterPlugin was answered, then each chunk of
        Synchronize (``syncing`` tells whether its first chunk arrived)."""
        await self._registered.wait()
        while not self.synchronized.is_set():
            if not self.configured:
                step = "Configure after RegisterPlugin"
            elif not syncing():
                step = "Synchronize after Configure"
            else:
                step = "the next Synchronize chunk"
            timeout_ms = self.registration_timeout_ms
            self._progress.clear()
            if self._answering:
                await self._progress.wait()
                continue
            if await wait_for_event(self._progress, timeout_ms / 1000) \
                    or self.synchronized.is_set():
                continue
            if peer.closed:
                return  # ended meanwhile, for a reason of its own (already logged)
            reject(Rejection.HANDSHAKE_TIMEOUT, f"no {step} within {timeout_ms} ms")
            log.warning("handshake_timeout", waiting_for=step, timeout_ms=timeout_ms)
            peer.close(f"handshake timeout: no {step} within {timeout_ms} ms")
            return
