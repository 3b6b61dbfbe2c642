"""The audit records an event leaves about its workload: a pod's annotations and labels left out
whole, a level's unusable QoS values, the answer's conflicts and deferred or skipped fields, and
what the answer applied (with its metric)."""

from __future__ import annotations

from common.audit import AuditLog
from common.metrics import PluginMetrics
from common.state import PodView
from hooks.model import PodInfo, RuntimeInfo
from hooks.untrusted import bounded
from nri_plugin.session import adjustment
from nri_plugin.wire.convert import ConvertedPod

SHOWN_KEYS = 4
"""Keys of the annotations and labels left out that a record names; the rest are counted."""


def record_ignored(audit: AuditLog, converted: ConvertedPod, *, container: str = "",
                   others: int = 0) -> None:
    """The record of a pod kept without its annotations and labels (``converted.ignored``);
    ``others``: how many more pods were, when one record stands for many."""
    keys = ", ".join(converted.ignored[:SHOWN_KEYS])
    if len(converted.ignored) > SHOWN_KEYS:
        keys += f" and {len(converted.ignored) - SHOWN_KEYS} more"
    more = f"; so were those of {others} more pods" if others else ""
    audit.record("adjustment_skipped", pod_uid=bounded(converted.info.uid), container=container,
                 reason=f"invalid input: annotations and labels ignored ({bounded(keys)}): "
                        f"{converted.reason}{more}")


class WorkloadRecords:
    """Writes the records to ``audit``; ``metrics`` hears of the fields the answers set."""

    def __init__(self, audit: AuditLog, metrics: PluginMetrics | None) -> None:
        self._audit = audit
        self._metrics = metrics

    def ignored(self, converted: ConvertedPod, container: str) -> None:
        """The pod's annotations and labels, left out whole at its first sight."""
        record_ignored(self._audit, converted, container=container)

    def level(self, view: PodView, container: str) -> None:
        """The QoS values the pod's level was decided without, as unusable."""
        decision = view.decision
        for source, value in decision.rejected:
            self._audit.record(
                "adjustment_skipped", pod_uid=bounded(view.info.uid), container=bounded(container),
                reason=f"{source}: unknown QoS value '{bounded(value)}'; level "
                       f"{decision.level} from {decision.source}",
            )

    def decided(self, decided: adjustment.Adjustment, pod_uid: str, name: str,
                runtime: RuntimeInfo) -> None:
        """What the answer could not carry as the capabilities asked: conflicts between them,
        fields left to the reconciler, fields the runtime would drop."""
        for conflict in decided.conflicts:
            self._audit.record(
                "adjustment_conflict", pod_uid=pod_uid, container=name,
                field=conflict.field, kept_owner=conflict.owner,
                rejected_owner=conflict.rejected_by,
            )
        for field in decided.deferred:
            self._audit.record("adjustment_deferred", pod_uid=pod_uid, container=name,
                               field=field, applied_by="reconciler after the container starts",
                               runtime=bounded(runtime.version))
        for _field, reason in decided.dropped:
            self._audit.record("adjustment_skipped", pod_uid=pod_uid, container=name,
                               reason=reason)

    def applied(self, pod: PodInfo, container: str, level: str,
                decided: adjustment.Adjustment) -> None:
        """The fields the answer set, once it is sent."""
        fields = adjustment.set_fields(decided.settings)
        self._audit.record("adjustment_applied", pod_uid=bounded(pod.uid),
                           pod_namespace=bounded(pod.namespace), pod_name=bounded(pod.name),
                           container=bounded(container), qos_level=level, fields=fields)
        if self._metrics is not None:
            # Annotation keys are the admin's: one label value for all of them.
            self._metrics.nri_adjusted(
                {"annotations" if f.startswith("annotations.") else f for f in fields})
