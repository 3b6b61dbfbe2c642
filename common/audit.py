"""The audit trail: a fixed catalogue of event names, each with its required fields.

Every layer that decides or writes something records it through an :class:`AuditLog` handed to it;
where the records go (the log stream, a rotated file) is the business of the sink the daemon
plugs in. A record whose name is not in :data:`CATALOGUE`, that lacks a required field or that uses
a field name the record itself needs (:data:`RESERVED_FIELDS`), is a programming error and raises,
so the catalogue and the code cannot drift apart. ``docs/audit.md`` documents the catalogue; a
test keeps the two in sync.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

AUDIT_LOGGER = "nri_qos.audit"
# Keys every audit line carries itself; a record's fields must not use them.
RESERVED_FIELDS = frozenset({"event", "timestamp", "logger", "audit", "level"})


@dataclass(frozen=True, slots=True)
class AuditEvent:
    name: str
    required: tuple[str, ...]
    description: str
    # The log level the record's line carries, so a log pipeline filtering on level keeps the
    # records that need someone's attention.
    level: str = "info"


def level_of(event: str) -> str:
    spec = CATALOGUE.get(event)
    return "info" if spec is None else spec.level


def _catalogue(*events: AuditEvent) -> Mapping[str, AuditEvent]:
    return MappingProxyType({e.name: e for e in events})


CATALOGUE: Mapping[str, AuditEvent] = _catalogue(
    AuditEvent("config_loaded", ("source",), "A configuration was validated and took effect."),
    AuditEvent("config_rejected", ("source", "errors"),
               "A configuration was invalid; the previous one stays in force.", level="error"),
    AuditEvent("config_restart_needed", ("source", "keys"),
               "A reload changed keys the agent reads at start only: keys maps each to its value "
               "in force and the new one, which takes effect at the next start; the rest of the "
               "configuration applies.", level="warning"),
    AuditEvent("adjustment_applied", ("pod_uid", "container", "qos_level", "fields"),
               "A CreateContainer answer carried these settings."),
    AuditEvent("adjustment_skipped", ("pod_uid", "container", "reason"),
               "A setting was left out (invalid input, missing feature, deadline, error)."),
    AuditEvent("adjustment_deferred", ("pod_uid", "container", "field", "applied_by"),
               "The runtime does not apply this field at creation; a background loop applies it "
               "to the container right after it starts."),
    AuditEvent("adjustment_conflict", ("pod_uid", "container", "field", "kept_owner",
                                       "rejected_owner"),
               "Two capabilities asked for different values of one field."),
    AuditEvent("qos_level_refused", ("pod_uid", "pod", "claim", "source", "reason"),
               "A pod claimed a QoS level above what its Kubernetes QoS class, its namespace or "
               "its level at creation allow; it runs at its class's level instead. Once per pod "
               "and refusal."),
    AuditEvent("event_failed", ("nri_event", "reason"),
               "An NRI event handler failed; the answer was empty, partial or an error.",
               level="error"),
    AuditEvent("cgroup_write", ("path", "value", "reason"), "A cgroup or procfs file was written."),
    AuditEvent("write_observed", ("path", "value", "reason"),
               "Observe mode: a cgroup, procfs or resctrl file would have been written; once per "
               "file and value."),
    AuditEvent("cgroup_write_failed", ("path", "value", "reason", "error"),
               "A write failed after its retries.", level="warning"),
    AuditEvent("resctrl_group_created", ("group", "schemata", "reason"),
               "A resctrl control group was created or its schemata rewritten."),
    AuditEvent("resctrl_group_removed", ("group", "reason"), "A resctrl group was removed."),
    AuditEvent("resctrl_fallback", ("pod_uid", "group", "reason"),
               "A pod-level group could not be had; the level's class group is used."),
    AuditEvent("tasks_moved", ("group", "count"), "Task ids were written into a resctrl group."),
    AuditEvent("memory_guard_cap", ("path", "cap_bytes", "previous_bytes"),
               "The reclaimed tier's memory cap or squeeze changed (cap_bytes null: no cap, "
               "the squeeze's memory.high alone)."),
    AuditEvent("numa_view_inconsistent", ("nodes_total_bytes", "system_total_bytes"),
               "The NUMA nodes' memory does not add up to the machine's (hot-added or ballooned "
               "memory); node-wide limits use /proc/meminfo."),
    AuditEvent("numa_binding", ("pod_uid", "container", "mems", "reason"),
               "A container's cpuset.mems was changed."),
    AuditEvent("numa_balance_step", ("pod_uid", "container", "from_node", "to_node",
                                      "asked_bytes", "moved_bytes", "duration_s", "result",
                                      "dry_run", "reason"),
               "A step moving a reclaimed container's memory off a NUMA node under its watermark "
               "(done, timeout, failed; dry_run and observed once while the same step is held); "
               "moved_bytes from memory.numa_stat before and after."),
    AuditEvent("annotation_ignored", ("pod_uid", "annotation", "reason"),
               "A pod annotation a background loop reads was not usable, so the node's or the "
               "level's value applies: the RSS overuse factor, or a memory QoS or oom_score_adj "
               "annotation the API server changed after the container was created (the "
               "creation-time answer records its own). Once per pod (and container) and value."),
    AuditEvent("detector_unknown", ("detector", "scope", "reason"),
               "A detector could not read its kernel file (missing, malformed, truncated); its "
               "level is unknown, never taken for no pressure. Once per cause."),
    AuditEvent("mitigation_level", ("ladder_level", "previous", "reason"),
               "The mitigation ladder's level changed (the worst level of its detectors)."),
    AuditEvent("mitigation_action", ("action", "step", "ladder_level", "result", "dry_run",
                                     "reason"),
               "A rung of the ladder was engaged, repeated or released, with its cause "
               "(detector, scope, value, threshold) and result (done, unchanged, dry_run, "
               "skipped, failed, timeout)."),
    AuditEvent("squeeze_judged", ("pod_uid", "detector", "before", "during", "verdict"),
               "The tune rung judged its squeeze judge_s after it began: the reading of the "
               "online pod that engaged it (before) against the same over the squeeze "
               "(during, with elapsed_s and unit); verdict relieved (kept) or futile (released "
               "and held off for hold_s)."),
    AuditEvent("offload_step", ("path", "pod_uid", "container", "asked_bytes", "verdict",
                                "result", "dry_run"),
               "An offloading step: what memory.reclaim was asked (asked_bytes, of wanted_bytes "
               "before the node's budget), why (verdict: grow, fast_grow, scan) and what the "
               "kernel reclaimed (reclaimed_bytes; file_freed_bytes, anon_freed_bytes), with "
               "result done, short (less than asked), timeout, gone, failed, observed, dry_run."),
    AuditEvent("offload_paused", ("reason",),
               "Offloading stopped while the mitigation ladder is engaged."),
    AuditEvent("offload_resumed", ("reason",),
               "Offloading started again after the ladder was released."),
    AuditEvent("drop_cache_started", ("path", "reason", "pod_uid", "usage_before_bytes"),
               "A drop-cache write to a reclaimed pod's memcg started."),
    AuditEvent("drop_cache_finished", ("path", "duration_s", "result", "pod_uid",
                                       "usage_before_bytes", "usage_after_bytes",
                                       "freed_bytes"),
               "A drop-cache write ended (done, short: cgroup v2's memory.reclaim freed less "
               "than asked, failed, timeout, skipped), with the pod's memory usage before and "
               "after."),
    AuditEvent("eviction_candidate", ("pod", "plugin", "reason"),
               "A plugin proposed the pod for eviction (once while it keeps proposing it)."),
    AuditEvent("eviction_filtered", ("pod", "plugin", "why"),
               "A proposed pod may not be evicted (system_cores, static, DaemonSet, priority, "
               "excluded, terminating, already being evicted); once while it stays so."),
    AuditEvent("eviction_proposals_capped", ("plugin", "omitted"),
               "A plugin proposed more pods in a round than are audited one by one (64); the "
               "others were filtered alike without a record each. Once while it lasts."),
    AuditEvent("eviction_deferred", ("pod", "plugin", "why"),
               "A pod chosen for eviction waits: the rate limit has no token, a refused or "
               "failed eviction backs off, or the API server throttled an earlier eviction of "
               "the round; once while it stays so."),
    AuditEvent("eviction_chosen", ("pod", "plugin", "reason", "dry_run"),
               "The manager decided to evict the pod now (after filtering, ranking and the rate "
               "limit)."),
    AuditEvent("eviction_dry_run", ("pod", "plugin", "reason"),
               "A chosen pod was not evicted: the manager or the plugin is in dry-run."),
    AuditEvent("eviction_requested", ("pod", "reason", "dry_run"), "An eviction was asked for."),
    AuditEvent("eviction_blocked", ("pod", "reason"),
               "The API refused an eviction (e.g. 429 from a PodDisruptionBudget; a 409 about "
               "the pod asked for), or it failed or could not be sent; with retry_after_s when "
               "the answer carried a Retry-After."),
    AuditEvent("eviction_gone", ("pod",),
               "The pod to evict no longer exists (404), or a 409 on the uid precondition and "
               "the pod read back is gone or another one."),
    AuditEvent("eviction_done", ("pod",), "The API accepted an eviction."),
    AuditEvent("eviction_condition", ("node", "condition", "status", "reason"),
               "A plugin's node condition changed (written to the node unless dry_run)."),
    AuditEvent("eviction_condition_removed", ("node", "condition", "reason"),
               "The eviction manager is disabled: a condition it keeps (or an earlier run "
               "left) was taken off the node."),
    AuditEvent("eviction_plugin_registered", ("plugin", "socket"),
               "An out-of-tree eviction plugin's socket appeared; the plugin is used."),
    AuditEvent("eviction_plugin_dropped", ("plugin", "reason"),
               "An out-of-tree plugin's socket disappeared or was refused; it is not used."),
    AuditEvent("eviction_plugin_failed", ("plugin", "call", "error"),
               "A plugin call missed its deadline, failed or answered something invalid; the "
               "plugin is skipped for the round (once per streak of failures)."),
    AuditEvent("eviction_plugin_recovered", ("plugin", "failures"),
               "A plugin answered again after failing."),
    AuditEvent("taint_added", ("node", "taint", "reason"), "A node taint was added."),
    AuditEvent("taint_removed", ("node", "taint", "reason"), "A node taint was removed."),
    AuditEvent("node_condition", ("node", "condition", "status", "reason"),
               "A node condition was set (its status or reason changed)."),
)


class AuditSink(Protocol):
    def __call__(self, event: str, fields: Mapping[str, Any]) -> None: ...


PodIdentity = Callable[[Mapping[str, Any]], Mapping[str, str]]
"""What the node knows of the pod a record is about (``pod_uid``, or ``pod`` as
``namespace/name``): the identity fields the record lacks, empty when the pod is unknown."""

POD_KEYS = frozenset({"pod_uid", "pod"})


class AuditLog:
    """Checks records against the catalogue and hands them to a sink (structlog in production).

    With :meth:`identify`, every record about a pod carries ``pod_uid``, ``pod_namespace`` and
    ``pod_name``, so records written where only the uid (or only the name) is at hand join with
    the rest and with the Kubernetes API's view."""

    def __init__(self, sink: AuditSink) -> None:
        self._sink = sink
        self._identity: PodIdentity | None = None

    def identify(self, identity: PodIdentity) -> None:
        self._identity = identity

    def record(self, event: str, /, **fields: Any) -> None:
        spec = CATALOGUE.get(event)
        if spec is None:
            raise ValueError(f"audit event {event!r} is not in the catalogue")
        missing = [name for name in spec.required if name not in fields]
        if missing:
            raise ValueError(f"audit event {event!r} lacks required fields: {', '.join(missing)}")
        reserved = sorted(RESERVED_FIELDS.intersection(fields))
        if reserved:
            raise ValueError(f"audit event {event!r} uses reserved field names: "
                             f"{', '.join(reserved)}")
        identity = self._identity
        if identity is not None and not POD_KEYS.isdisjoint(fields) and not (
                "pod_namespace" in fields and "pod_name" in fields and "pod_uid" in fields):
            fields = {**identity(fields), **fields}
        self._sink(event, fields)


class MemoryAuditSink:
    """Keeps records in a list; for tests and the simulator's report."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None:
        self.records.append((event, dict(fields)))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.records if name == event]
