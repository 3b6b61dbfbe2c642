"""Every alert of the PrometheusRule has a panel on the Grafana dashboard that shows the series
it fires on: the same series (a panel may select more of them, never fewer), still told apart
by the labels the alert reports, so an operator paged by an alert finds its cause on the
dashboard."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import prometheus_client
import promql_parser
from prometheus_client.parser import text_string_to_metric_families

from tests.support.monitoring import DASHBOARD, rules
from tests.support.populated_metrics import populated_registry

WHERE = frozenset({"namespace", "pod", "node", "job", "instance", "le"})
"""Labels that say which agent (or which histogram bucket) a sample is from rather than what it
is about: the dashboard picks agents with its node variable and may sum over them."""


@dataclass(frozen=True)
class View:
    """What one selector of an expression lets through: the metric, its label matchers (those
    on a dashboard variable left out) and the labels that survive the aggregations around it
    (None: all of them)."""

    name: str
    matchers: frozenset[tuple[str, str, str]]
    kept: frozenset[str] | None


def views(expr: str) -> list[View]:
    found: list[View] = []

    def walk(node: Any, kept: frozenset[str] | None) -> None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            matchers = frozenset(
                (m.name, str(m.op), m.value) for m in node.matchers.matchers
                if "$" not in m.value)
            found.append(View(node.name, matchers, kept))
            return
        if kind == "AggregateExpr":
            modifier = node.modifier
            # ``without`` would need every series' labels here; no expression uses it.
            assert modifier is None or modifier.type == promql_parser.AggModifierType.By, expr
            labels = frozenset(modifier.labels if modifier is not None else ())
            kept = labels if kept is None else kept & labels
        for attr in ("expr", "lhs", "rhs", "args", "vector_selector"):
            child = getattr(node, attr, None)
            for item in child if isinstance(child, list) else [child]:
                if item is not None and not isinstance(item, str | int | float):
                    walk(item, kept)

    walk(promql_parser.parse(expr), None)
    return found


def series_labels() -> dict[str, frozenset[str]]:
    text = prometheus_client.generate_latest(populated_registry()).decode()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(names) for name, names in labels.items()}


def shows(panel: View, alert: View, labels: dict[str, frozenset[str]]) -> bool:
    """Whether ``panel`` shows every series ``alert`` selects, told apart as the alert does."""
    if panel.name != alert.name or not panel.matchers <= alert.matchers:
        return False
    told_apart = {name for name, _, _ in alert.matchers - panel.matchers}
    told_apart |= (labels.get(alert.name, frozenset()) if alert.kept is None else alert.kept)
    return panel.kept is None or told_apart - WHERE <= panel.kept


def panel_views() -> dict[str, list[View]]:
    by_title: dict[str, list[View]] = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            by_title.setdefault(panel["title"], []).extend(views(target["expr"]))
    return by_title


def unshown(alert_expr: str, panels: dict[str, list[View]],
            labels: dict[str, frozenset[str]]) -> list[View]:
    return [a for a in views(alert_expr)
            if not any(shows(p, a, labels) for seen in panels.values() for p in seen)]


def test_the_check_tells_a_panel_that_hides_what_an_alert_fires_on() -> None:
    labels = series_labels()
    alert = ('sum by (namespace, pod, node, file) '
             '(increase(nri_qos_host_writes_total{outcome=~"failed|timeout"}[15m])) > 0')
    by_outcome = {"all": views(
        'sum by (outcome) (rate(nri_qos_host_writes_total{node=~"$node"}[5m]))')}
    by_file = {"refused": views(
        'sum by (node, file, outcome) '
        '(increase(nri_qos_host_writes_total{outcome=~"failed|timeout", node=~"$node"}[15m]))')}
    other_outcome = {"gone": views(
        'sum by (file) (increase(nri_qos_host_writes_total{outcome="gone"}[15m]))')}
    assert unshown(alert, by_outcome, labels)  # the file the alert names is summed away
    assert unshown(alert, other_outcome, labels)  # other series than the alert's
    assert not unshown(alert, by_file, labels)
    blind = "max by (namespace, pod, node, detector) (nri_qos_detector_level == -1) == -1"
    node_scope = {"node": views(
        'max by (node, detector) (nri_qos_detector_level{scope="node", node=~"$node"})')}
    assert unshown(blind, node_scope, labels)  # pods' scopes are left out
    # An alert on a series without aggregation keeps its labels: a panel must too.
    assert unshown("nri_qos_evictions_total > 0", {"sum": views(
        "sum(nri_qos_evictions_total)")}, labels)


def test_every_alert_has_a_panel_showing_what_it_fires_on() -> None:
    labels = series_labels()
    panels = panel_views()
    missing = {rule["alert"]: [v.name for v in unshown(rule["expr"], panels, labels)]
               for rule in rules()}
    assert {alert: names for alert, names in missing.items() if names} == {}
