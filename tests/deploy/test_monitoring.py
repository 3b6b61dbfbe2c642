"""What deploy/ ships for monitoring: the Grafana dashboard and the PrometheusRule use only
series the agent exports, in PromQL that parses; the Prometheus Operator, NetworkPolicy and
metrics-address wiring of the manifests."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nri_plugin.cli.nri_qos import build_parser
from tests.support.manifests import (
    BASE,
    COMPONENTS,
    assert_parses_into_models,
    built,
    container_of,
    one,
)
from tests.support.monitoring import DASHBOARD, rules
from tests.support.populated_metrics import populated_registry

PROMETHEUS_OWN = {"up"}
"""Series Prometheus makes itself for every target; the rules and the dashboard may use them."""


def exported() -> set[str]:
    """Every sample name the agent's registry renders, each series given a value."""
    text = prometheus_client.generate_latest(populated_registry()).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def selectors(expr: str) -> set[str]:
    """The metric names an expression selects."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if type(node).__name__ == "VectorSelector":
            found.add(node.name)
        for attr in ("expr", "lhs", "rhs", "args", "vector_selector", "param"):
            child = getattr(node, attr, None)
            for item in child if isinstance(child, list) else [child]:
                if item is not None and not isinstance(item, str | int | float):
                    walk(item)

    walk(promql_parser.parse(expr))
    return found


def dashboard_exprs() -> Iterator[str]:
    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    yield value
                else:
                    yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    return walk(json.loads(DASHBOARD.read_text()))


def test_the_check_catches_a_series_that_does_not_exist() -> None:
    names = exported()
    assert "nri_qos_nri_requests_total" in names
    assert "nri_qos_nri_request_duration_seconds_bucket" in names
    assert selectors("rate(nri_qos_nri_requests_totl[5m])") - names == {
        "nri_qos_nri_requests_totl"}
    with pytest.raises(ValueError):  # noqa: PT011 - the parser's own error type
        promql_parser.parse("sum by (le (rate(x[5m]))")


def test_every_dashboard_expression_parses_and_names_exported_series() -> None:
    names = exported() | PROMETHEUS_OWN
    exprs = list(dashboard_exprs())
    assert len(exprs) >= 10
    for expr in exprs:
        assert selectors(expr) <= names, (expr, selectors(expr) - names)
    template = json.loads(DASHBOARD.read_text())["templating"]["list"]
    (node,) = [v for v in template if v["name"] == "node"]
    assert node["definition"] == "label_values(nri_qos_build_info, node)"
    assert "nri_qos_build_info" in names


def test_every_alert_parses_and_names_exported_series() -> None:
    names = exported() | PROMETHEUS_OWN
    found = {rule["alert"]: rule for rule in rules()}
    assert set(found) == {"NriQosAgentDown", "NriQosNotSynchronized", "NriQosAnswerNearTimeout",
                          "NriQosLadderEngagedLong", "NriQosEvictions", "NriQosWireRejections",
                          "NriQosConfigRefused", "NriQosHostWritesRefused", "NriQosLoopFailing",
                          "NriQosDetectorBlind"}
    for rule in found.values():
        assert selectors(rule["expr"]) <= names, (rule["alert"], selectors(rule["expr"]) - names)
        assert rule["labels"]["severity"] in ("info", "warning", "critical")


def with_components(tmp_path: Path, *components: str) -> list[dict[str, Any]]:
    base = os.path.relpath(BASE, tmp_path)
    used = ", ".join(os.path.relpath(COMPONENTS / c, tmp_path) for c in components)
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{base}]\ncomponents: [{used}]\n")
    return built(tmp_path)


def test_the_prometheus_operator_component_scrapes_the_agents(tmp_path: Path) -> None:
    docs = with_components(tmp_path, "prometheus-operator")
    monitor = one(docs, "PodMonitor")
    rule = one(docs, "PrometheusRule")
    daemonset = one(docs, "DaemonSet")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"] for p in container_of(daemonset)["ports"]}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
    # The series' own namespace and pod labels (a workload pod's) are kept.
    assert all(e["honorLabels"] for e in monitor["spec"]["podMetricsEndpoints"])
    # AgentDown names the job the PodMonitor makes: <namespace>/<name>.
    job = f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
    down = next(r for g in rule["spec"]["groups"] for r in g["rules"]
                if r["alert"] == "NriQosAgentDown")
    assert f'job="{job}"' in down["expr"]


def test_the_network_policy_lets_only_the_metrics_port_in(tmp_path: Path) -> None:
    docs = with_components(tmp_path, "network-policy")
    policy = one(docs, "NetworkPolicy")
    assert_parses_into_models([policy])
    daemonset = one(docs, "DaemonSet")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= daemonset["spec"]["template"][
        "metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [
        p["containerPort"] for p in container_of(daemonset)["ports"]]


def test_the_metrics_endpoint_listens_on_the_pod_ip() -> None:
    daemonset = one(built(BASE), "DaemonSet")
    container = container_of(daemonset)
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.metrics_address == "$(POD_IP)"
    (pod_ip,) = [e for e in container["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
