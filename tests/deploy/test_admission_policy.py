"""The admission policy in ``deploy/admission`` refuses at the API server the claims the agent
refuses on the node: its CEL is evaluated (cel-python) over the same table as the agent's
policy, for pods as the API server holds them at CREATE and UPDATE."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import celpy
import pytest
import yaml
from celpy.adapter import json_to_cel

from tests.support.paths import REPO
from tests.support.qos_claims import CASES, KOORD, OURS, Claim

POLICY = REPO / "deploy" / "admission" / "qos-level-policy.yaml"


@pytest.fixture(autouse=True)
def _recursion_limit() -> Iterator[None]:
    """celpy raises the interpreter's recursion limit for good; the other tests' bounds on
    nesting expect the default, so it is put back."""
    limit = sys.getrecursionlimit()
    yield
    sys.setrecursionlimit(limit)


def docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(POLICY.read_text()) if d is not None]


def policy() -> dict[str, Any]:
    (found,) = [d for d in docs() if d["kind"] == "ValidatingAdmissionPolicy"]
    return found


def admitted(obj: dict[str, Any]) -> bool:
    """Whether every validation holds for ``obj``, evaluating the variables in order."""
    spec = policy()["spec"]
    env = celpy.Environment()
    variables: dict[str, Any] = {}

    def evaluate(expression: str) -> Any:
        program = env.program(env.compile(expression))
        return program.evaluate({"object": json_to_cel(obj),
                                 "variables": celpy.celtypes.MapType(variables)})

    for variable in spec["variables"]:
        variables[celpy.celtypes.StringType(variable["name"])] = evaluate(variable["expression"])
    return all(bool(evaluate(v["expression"])) for v in spec["validations"])


def pod(namespace: str, qos_class: str | None, annotations: dict[str, str] | None = None,
        labels: dict[str, str] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "p", "namespace": namespace}
    if annotations is not None:
        metadata["annotations"] = annotations
    if labels is not None:
        metadata["labels"] = labels
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
                           "spec": {"containers": [{"name": "c", "image": "i"}]}}
    if qos_class is not None:
        obj["status"] = {"qosClass": qos_class}
    return obj


def test_the_manifest_is_a_policy_and_its_binding_for_pod_creates_and_updates() -> None:
    kinds = {d["kind"]: d for d in docs()}
    assert set(kinds) == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    spec = kinds["ValidatingAdmissionPolicy"]["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"]) == ([""], ["pods"])
    assert sorted(rule["operations"]) == ["CREATE", "UPDATE"]
    binding = kinds["ValidatingAdmissionPolicyBinding"]["spec"]
    assert binding["policyName"] == kinds["ValidatingAdmissionPolicy"]["metadata"]["name"]
    assert binding["validationActions"] == ["Deny"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_policy_refuses_what_the_agent_refuses(case: Claim) -> None:
    written = {case.key: case.value}
    obj = pod(case.namespace, case.qos_class,
              annotations=written if case.kind == "annotation" else None,
              labels=written if case.kind == "label" else None)
    assert admitted(obj) is case.allowed


@pytest.mark.parametrize("qos_class", ["BestEffort", "Burstable", "Guaranteed"])
def test_a_pod_without_claims_is_admitted(qos_class: str) -> None:
    assert admitted(pod("batch", qos_class))
    assert admitted(pod("batch", qos_class, annotations={"app": "x"}, labels={"app": "x"}))


def test_unknown_values_and_other_spellings_claim_nothing() -> None:
    # The agent ignores them too (not a level, not ASCII), so nothing is refused.
    assert admitted(pod("batch", "BestEffort", annotations={OURS: "System_Cores"}))
    assert admitted(pod("batch", "BestEffort", labels={KOORD: "\u017fYSTEM"}))


def test_an_update_that_adds_a_claim_is_refused_as_a_create_would_be() -> None:
    # UPDATE is evaluated on the new object: status.qosClass stays what the API server set.
    assert not admitted(pod("batch", "BestEffort", annotations={OURS: "system_cores"}))
    assert admitted(pod("kube-system", "BestEffort", annotations={OURS: "system_cores"}))
