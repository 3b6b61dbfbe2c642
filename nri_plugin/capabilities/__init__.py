"""The creation-time capabilities: resctrl, memory QoS, oom score, OCI hooks.

Each wraps its pure policy from :mod:`hooks` and turns the policy's problems into audit records
(``adjustment_skipped``); with ``plugin.strict`` it then raises
:class:`hooks.errors.InvalidInput`, which the stub answers with an error. A reload reaches them
through :meth:`~nri_plugin.session.capability.Capability.reconfigure`. Memory QoS, oom score and
OCI hooks are always built and answer nothing while the configuration in force switches them
off, so a reload switches them on and off from the next event (their event, CreateContainer, is
followed for the node state anyway: the subscription is the same). The resctrl capability needs
the resctrl filesystem, opened at start: it is built when resctrl is on at start and usable
(``resctrl.enabled`` is a start-only switch, :mod:`nri_plugin.config.start_only`).
"""

from __future__ import annotations

from common.audit import AuditLog
from common.state import NodeState
from nri_plugin.capabilities.memory_qos import MemoryQosCapability
from nri_plugin.capabilities.oci_hooks import OciHooksCapability
from nri_plugin.capabilities.oom_score import OomScoreCapability
from nri_plugin.capabilities.resctrl import ResctrlCapability
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability
from reconciler.host.resctrlfs import ResctrlFs


def build_capabilities(config: Config, *, resctrl: ResctrlFs | None, state: NodeState,
                       audit: AuditLog, cgroup_v2: bool, memory_total: int) -> list[Capability]:
    """The capabilities, in chain order (earlier ones own a field on conflict).

    ``resctrl`` is None when resctrl is unavailable: no CLOS is ever emitted then. ``state``
    tells the resctrl capability which sandboxes of a pod are still there.
    ``memory_total`` (bytes) is the host's memory, used unless the config sets
    ``memory.node_allocatable_bytes``.
    """
    strict = config.plugin.strict
    capabilities: list[Capability] = []
    if config.resctrl.enabled and resctrl is not None:
        capabilities.append(ResctrlCapability(config.resctrl, resctrl, audit, state=state,
                                              strict=strict))
    capabilities.append(MemoryQosCapability(config.memory, audit, strict=strict,
                                            cgroup_v2=cgroup_v2, memory_total=memory_total))
    capabilities.append(OomScoreCapability(config.oom, audit, strict=strict))
    capabilities.append(OciHooksCapability(config.oci_hooks))
    return capabilities
