"""What deploy/ ships for monitoring, as the tests read it: the Grafana dashboard and the
PrometheusRule's rules."""

from __future__ import annotations

from typing import Any

import yaml

from tests.support.manifests import COMPONENTS
from tests.support.paths import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "nri-qos-dashboard.json"
RULES = COMPONENTS / "prometheus-operator" / "prometheusrule.yaml"


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["spec"]["groups"] for rule in group["rules"]]
