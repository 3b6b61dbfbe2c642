"""What Configure settled for one connection, handed by value to whoever serves its requests.

The event handler and Synchronize read the runtime's support, its identity and its request
timeout from a :class:`SessionTerms` they are given, never from the session that owns the
connection: a new connection gets new terms, and the terms a request started with are the ones
it finishes with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hooks.model import RuntimeInfo
from nri_plugin.config.schema import PluginConfig
from nri_plugin.wire.convert import MAX_NAME_CHARS
from nri_plugin.wire.nri_api import DEFAULT_REGISTRATION_TIMEOUT_MS, DEFAULT_REQUEST_TIMEOUT_MS
from nri_plugin.wire.runtime_support import UNCONFIGURED, RuntimeSupport
from protos import nri_api_pb2 as api

MIN_DEADLINE_MS = 10.0
MAX_REQUEST_TIMEOUT_MS = 3_600_000
"""Longer request or registration timeouts than an hour are taken for garbage (the runtime
default applies)."""


@dataclass(frozen=True, slots=True)
class SessionTerms:
    """The connected runtime's support and identity (as policies see it) and its request timeout.

    The defaults are those of a connection Configure has not set up yet.
    """

    support: RuntimeSupport = UNCONFIGURED
    runtime: RuntimeInfo = field(default_factory=RuntimeInfo)
    request_timeout_ms: int = DEFAULT_REQUEST_TIMEOUT_MS

    @classmethod
    def from_configure(cls, req: api.ConfigureRequest, *, cgroup_v2: bool) -> SessionTerms:
        """The terms a Configure request states (on a host of the cgroup version given)."""
        support = RuntimeSupport.detect(req.NRI_version, req.runtime_name, req.runtime_version)
        return cls(
            support=support,
            # Kept for the session and shown to policies: cut to what any real name fits in.
            runtime=RuntimeInfo(name=req.runtime_name[:MAX_NAME_CHARS],
                                version=req.runtime_version[:MAX_NAME_CHARS],
                                nri_version=support.nri_version, cgroup_v2=cgroup_v2),
            request_timeout_ms=_timeout_ms(req.request_timeout, DEFAULT_REQUEST_TIMEOUT_MS),
        )

    def deadline_ms(self, plugin: PluginConfig) -> float:
        """Budget of one handler: the configured deadline, kept below the runtime's timeout."""
        budget = self.request_timeout_ms - plugin.deadline_margin_ms
        return max(MIN_DEADLINE_MS, float(min(plugin.deadline_ms, budget)))


def registration_timeout_ms(req: api.ConfigureRequest) -> int:
    """The deadline of each later step of the handshake, as Configure states it."""
    return _timeout_ms(req.registration_timeout, DEFAULT_REGISTRATION_TIMEOUT_MS)


def _timeout_ms(stated: int, default: int) -> int:
    # 0 means "not sent" (NRI before 0.7); anything absurd is treated the same way.
    return stated if 0 < stated <= MAX_REQUEST_TIMEOUT_MS else default
