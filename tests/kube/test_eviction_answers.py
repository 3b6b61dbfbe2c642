"""What an eviction's 409 and 429 answers mean: a conflict is ``gone`` only when the pod read
back under that name (once, under a bound of its own) is another one or none, a 429 says
whether the API server throttles, and a ``Retry-After`` comes back with the result, bounded.
The real client against the fake API server on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from common.audit import AuditLog, MemoryAuditSink
from reconciler.kube import EvictionOutcome, KubeActions, KubernetesConfig
from reconciler.kube.evictions import MAX_RETRY_AFTER_S, READ_BACK_TIMEOUT_S, retry_after
from tests.support.fake_apiserver import FakeApiServer, client_config, make_pod

EVICTION = "/api/v1/namespaces/default/pods/batch/eviction"
POD = "/api/v1/namespaces/default/pods/batch"


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def cfg(tmp_path: Path, fake: FakeApiServer) -> KubernetesConfig:
    return client_config(tmp_path, fake, request_timeout_s=5.0, retry_max_s=0.2)


@pytest.fixture
def audit() -> MemoryAuditSink:
    return MemoryAuditSink()


@pytest.fixture
def actions(api: Any, cfg: KubernetesConfig, audit: MemoryAuditSink) -> KubeActions:
    return KubeActions(api, cfg, AuditLog(audit))


# ---- 409 ----------------------------------------------------------------------------------------


async def test_a_conflict_about_the_same_pod_fails_and_leaves_it_to_be_tried_again(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink
) -> None:
    fake.add_pod(make_pod("batch", uid="uid-1"))
    fake.fail_next("POST", EVICTION, 409)
    result = await actions.evict("default", "batch", None, False, uid="uid-1")
    assert (result.outcome, result.status) == (EvictionOutcome.FAILED, 409)
    assert [r.status for r in fake.requests("GET", POD)] == [200]
    assert audit.named("eviction_gone") == []
    (blocked,) = audit.named("eviction_blocked")
    assert blocked["status"] == 409
    assert blocked["reason"] == ("API answered conflict, the pod is still the one asked for: "
                                 "injected failure 409")
    # Tried again, it goes.
    assert (await actions.evict("default", "batch", None, False, uid="uid-1")).outcome is \
        EvictionOutcome.EVICTED


@pytest.mark.parametrize("api_has", ["another pod", "no pod"])
async def test_a_conflict_with_the_pod_replaced_or_gone_is_gone(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink, api_has: str
) -> None:
    if api_has == "another pod":
        # The API's own answer to a uid precondition that does not hold.
        fake.add_pod(make_pod("batch", uid="uid-2"))
    else:
        fake.fail_next("POST", EVICTION, 409)
    result = await actions.evict("default", "batch", None, False, uid="uid-1")
    assert (result.outcome, result.status) == (EvictionOutcome.GONE, 409)
    assert [r.status for r in fake.requests("GET", POD)] == [
        200 if api_has == "another pod" else 404]
    # The record is about the pod asked for, not the one the API has under its name now.
    assert audit.named("eviction_gone") == [
        {"pod": "default/batch", "pod_uid": "uid-1", "status": 409}]
    assert audit.named("eviction_blocked") == []


@pytest.mark.parametrize(("trouble", "detail"), [
    ("500", "HTTP 500: injected failure 500"),
    ("timeout", "ReadTimeoutError"),
    ("no uid", "ValueError: pod has no metadata.uid"),
])
async def test_a_conflict_whose_pod_cannot_be_read_back_fails(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig, audit: MemoryAuditSink,
    trouble: str, detail: str,
) -> None:
    fake.add_pod(make_pod("batch", uid="uid-1"))
    fake.fail_next("POST", EVICTION, 409)
    if trouble == "500":
        fake.fail_next("GET", POD, 500)
    elif trouble == "timeout":
        fake.delay_next("GET", POD, 3.0)
        cfg = replace(cfg, request_timeout_s=0.3)
    else:
        fake.modify_pod("default", "batch", lambda pod: pod["metadata"].pop("uid"))
    actions = KubeActions(api, cfg, AuditLog(audit))
    result = await actions.evict("default", "batch", None, False, uid="uid-1")
    assert (result.outcome, result.status) == (EvictionOutcome.FAILED, 409)
    assert audit.named("eviction_gone") == []
    (blocked,) = audit.named("eviction_blocked")
    assert blocked["reason"].startswith(
        "API answered conflict, and the pod could not be read back: ")
    assert detail in blocked["reason"]
    assert fake.pod("default", "batch") is not None


async def test_the_read_back_is_sent_once_under_the_request_timeout_when_shorter(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig, audit: MemoryAuditSink
) -> None:
    """urllib3 would send a GET that timed out three more times, each with the whole timeout:
    the round's next candidates would wait for all four."""
    fake.add_pod(make_pod("batch", uid="uid-1"))
    fake.fail_next("POST", EVICTION, 409)
    fake.delay_next("GET", POD, 3.0, count=10)
    actions = KubeActions(api, replace(cfg, request_timeout_s=0.3), AuditLog(audit))
    started = time.monotonic()
    result = await actions.evict("default", "batch", None, False, uid="uid-1")
    assert time.monotonic() - started < 2 * 0.3
    assert result.outcome is EvictionOutcome.FAILED
    assert len(fake.requests("GET", POD)) == 1
    assert "ReadTimeoutError" in audit.named("eviction_blocked")[0]["reason"]


@pytest.mark.parametrize(("delay_s", "read"), [
    (READ_BACK_TIMEOUT_S - 0.5, True), (READ_BACK_TIMEOUT_S + 1.5, False)])
async def test_the_read_back_waits_at_most_its_own_bound_under_a_longer_request_timeout(
    fake: FakeApiServer, actions: KubeActions, cfg: KubernetesConfig, audit: MemoryAuditSink,
    delay_s: float, read: bool,
) -> None:
    assert (READ_BACK_TIMEOUT_S, cfg.request_timeout_s) == (2.0, 5.0)
    fake.add_pod(make_pod("batch", uid="uid-1"))
    fake.fail_next("POST", EVICTION, 409)
    fake.delay_next("GET", POD, delay_s)
    started = time.monotonic()
    result = await actions.evict("default", "batch", None, False, uid="uid-1")
    took = time.monotonic() - started
    assert result.outcome is EvictionOutcome.FAILED
    (blocked,) = audit.named("eviction_blocked")
    if read:
        assert blocked["reason"].startswith("API answered conflict, the pod is still the one")
        assert delay_s <= took < READ_BACK_TIMEOUT_S
    else:
        assert "ReadTimeoutError" in blocked["reason"]
        assert READ_BACK_TIMEOUT_S <= took < READ_BACK_TIMEOUT_S + 1.0
    assert len(fake.requests("GET", POD)) == 1


async def test_a_conflict_without_a_uid_precondition_fails_unread(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink
) -> None:
    fake.add_pod(make_pod("batch"))
    fake.fail_next("POST", EVICTION, 409)
    result = await actions.evict("default", "batch", None, False)
    assert (result.outcome, result.status) == (EvictionOutcome.FAILED, 409)
    assert fake.requests("GET", POD) == []
    assert audit.named("eviction_blocked")[0]["reason"] == "API error: injected failure 409"


# ---- Retry-After --------------------------------------------------------------------------------


@pytest.mark.parametrize(("header", "carried"), [
    ("7", 7),
    ("0", 0),
    (str(MAX_RETRY_AFTER_S), MAX_RETRY_AFTER_S),
    (str(MAX_RETRY_AFTER_S + 1), MAX_RETRY_AFTER_S),
    ("99999999999999999999999", MAX_RETRY_AFTER_S),
    ("-3", None),
    ("7.5", None),
    ("soon", None),
    ("Wed, 21 Oct 2015 07:28:00 GMT", None),
    ("", None),
])
async def test_a_throttled_eviction_carries_its_retry_after_bounded(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink,
    header: str, carried: int | None,
) -> None:
    fake.add_pod(make_pod("batch"))
    fake.fail_next("POST", EVICTION, 429, retry_after=header)
    result = await actions.evict("default", "batch", None, False)
    assert (result.outcome, result.retry_after_s) == (EvictionOutcome.BLOCKED, carried)
    assert result.throttled
    (blocked,) = audit.named("eviction_blocked")
    assert blocked.get("retry_after_s") == carried


async def test_a_failed_eviction_carries_its_retry_after_too(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink
) -> None:
    fake.add_pod(make_pod("batch"))
    fake.fail_next("POST", EVICTION, 503, retry_after="7")
    result = await actions.evict("default", "batch", None, False)
    assert (result.outcome, result.status, result.retry_after_s) == (
        EvictionOutcome.FAILED, 503, 7)
    assert audit.named("eviction_blocked")[0]["retry_after_s"] == 7


@pytest.mark.parametrize(("header", "carried"), [(None, None), ("10", 10)])
async def test_a_disruption_budget_refusal_carries_its_retry_after_when_it_sends_one(
    fake: FakeApiServer, actions: KubeActions, header: str | None, carried: int | None
) -> None:
    fake.add_pod(make_pod("batch"))
    fake.block_eviction("default", "batch", retry_after=header)
    result = await actions.evict("default", "batch", None, False)
    assert (result.outcome, result.retry_after_s) == (EvictionOutcome.BLOCKED, carried)
    assert "disruption budget" in result.message
    assert not result.throttled  # about this pod only


def test_the_retry_after_header_is_found_in_any_case() -> None:
    assert MAX_RETRY_AFTER_S == 300
    assert retry_after({"retry-after": "7"}) == 7
    assert retry_after({"RETRY-AFTER": " 8 "}) == 8
    assert retry_after({"Content-Type": "application/json"}) is None
    assert retry_after({"Retry-After": "\u0667"}) is None  # a digit, but not an ASCII one
