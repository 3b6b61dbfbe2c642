"""The creation-time capabilities: resctrl, memory QoS, oom score, OCI hooks.

Each wraps its pure policy from :mod:`hooks` and turns the policy's problems into audit records
(``adjustment_skipped``); with ``plugin.strict`` it then raises
:class:`hooks.errors.InvalidInput`, which the stub answers with an error. Only enabled
capabilities are built, so the subscription mask holds only the events they need. A reload
reaches the built capabilities through
:meth:`~nri_plugin.session.capability.Capability.reconfigure`; switching a capability on or
off takes effect at the next connection, where the subscription is negotiated again.
"""

from __future__ import annotations

from common.audit import AuditLog
from common.state import NodeState
from hooks.memory_qos import memory_qos_active
from hooks.oci_hooks import any_hooks
from nri_plugin.capabilities.memory_qos import MemoryQosCapability
from nri_plugin.capabilities.oci_hooks import OciHooksCapability
from nri_plugin.capabilities.oom_score import OomScoreCapability
from nri_plugin.capabilities.resctrl import ResctrlCapability
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability
from reconciler.host.resctrlfs import ResctrlFs


def build_capabilities(config: Config, *, resctrl: ResctrlFs | None, state: NodeState,
                       audit: AuditLog, cgroup_v2: bool, memory_total: int) -> list[Capability]:
    """The enabled capabilities, in chain order (earlier ones own a field on conflict).

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
    if memory_qos_active(config.memory):
        capabilities.append(MemoryQosCapability(config.memory, audit, strict=strict,
                                                cgroup_v2=cgroup_v2, memory_total=memory_total))
    if config.oom.enabled:
        capabilities.append(OomScoreCapability(config.oom, audit, strict=strict))
    if any_hooks(config.oci_hooks):
        capabilities.append(OciHooksCapability(config.oci_hooks))
    return capabilities
