"""Memory QoS policy: Volcano ratios, the Kubernetes formula, the Volcano annotation, cgroup v1."""

from __future__ import annotations

import dataclasses

import pytest

from hooks.config_fields import frozen_map
from hooks.memory_qos import (
    VOLCANO_ANNOTATION,
    MemoryConfig,
    MemoryLevel,
    Ratios,
    memory_settings,
    parse_volcano,
)
from hooks.model import ContainerInfo, PodInfo
from tests.support.builders import pod

MI = 1 << 20
GI = 1 << 30
CFG = MemoryConfig()


def ctr(limit: int | None = 512 * MI, request: int | None = 256 * MI) -> ContainerInfo:
    return ContainerInfo(id="c1", pod_sandbox_id="sb", name="c", memory_limit=limit,
                         memory_request=request)


def with_level(level: str, **fields: object) -> MemoryConfig:
    """The defaults with ``level`` replaced by a level of these fields only (the rest as the
    class declares them: policy none)."""
    levels = dict(CFG.levels)
    levels[level] = MemoryLevel(**fields)  # type: ignore[arg-type]
    return dataclasses.replace(CFG, levels=frozen_map(levels))


def unified(level: str, *, cfg: MemoryConfig = CFG, p: PodInfo | None = None,
            c: ContainerInfo | None = None, allocatable: int = 8 * GI) -> dict[str, str]:
    d = memory_settings(p or pod(), c or ctr(), level, cfg, cgroup_v2=True,
                        node_allocatable=allocatable)
    assert d.problems == ()
    return dict(d.settings.unified)


def test_reclaimed_default_is_95_percent_of_limit() -> None:
    assert unified("reclaimed_cores") == {"memory.high": "510025728"}


def test_online_levels_default_to_their_request_as_memory_low() -> None:
    """memory.low = the request, to the byte, and nothing else (no memory.min, no memory.high)."""
    for level in ("dedicated_cores", "shared_cores"):
        assert unified(level) == {"memory.low": str(256 * MI)}
        assert unified(level, c=ctr(limit=None, request=256 * MI + 4095)) == {
            "memory.low": str(256 * MI)}
        assert unified(level, c=ctr(request=None)) == {}


def test_system_cores_defaults_to_nothing() -> None:
    d = memory_settings(pod(), ctr(), "system_cores", CFG, cgroup_v2=True,
                        node_allocatable=8 * GI)
    assert d.settings.is_empty()


def test_online_levels_default_to_nothing_on_cgroup_v1() -> None:
    for level in ("dedicated_cores", "shared_cores"):
        d = memory_settings(pod(), ctr(), level, CFG, cgroup_v2=False, node_allocatable=8 * GI)
        assert d.settings.is_empty()


def test_unknown_level_is_no_opinion() -> None:
    d = memory_settings(pod(), ctr(), "bogus", CFG, cgroup_v2=True, node_allocatable=0)
    assert d.settings.is_empty()


def test_ratios_policy() -> None:
    cfg = with_level("shared_cores", policy="ratios", min_ratio=50, low_ratio=80, high_ratio=90)
    assert unified("shared_cores", cfg=cfg) == {
        "memory.min": str(128 * MI), "memory.low": str(int(256 * MI * 0.8) // 4096 * 4096),
        "memory.high": str(int(512 * MI * 0.9) // 4096 * 4096)}


def test_a_high_ratio_of_0_sets_no_memory_high() -> None:
    """As min_ratio and low_ratio 0 set nothing: a memory.high of 0 would stop the container."""
    cfg = with_level("shared_cores", policy="ratios", min_ratio=100, high_ratio=0)
    assert unified("shared_cores", cfg=cfg) == {"memory.min": str(256 * MI)}
    one = with_level("shared_cores", policy="ratios", min_ratio=100, high_ratio=1)
    assert unified("shared_cores", cfg=one) == {
        "memory.min": str(256 * MI), "memory.high": str(int(512 * MI * 0.01) // 4096 * 4096)}


def test_kubernetes_formula() -> None:
    cfg = with_level("shared_cores", policy="kubernetes")
    # floor((256Mi + 0.9 x (512Mi - 256Mi)) / page) x page
    assert unified("shared_cores", cfg=cfg) == {"memory.high": "510025728"}
    no_limit = unified("shared_cores", cfg=cfg, c=ctr(limit=None, request=None))
    assert no_limit == {"memory.high": "7730937856"}   # 0.9 x 8 GiB of allocatable


@pytest.mark.parametrize("policy", ["ratios", "kubernetes"])
def test_no_limit_skip(policy: str) -> None:
    cfg = with_level("shared_cores", policy=policy, no_limit="skip")
    assert unified("shared_cores", cfg=cfg, c=ctr(limit=None)) == {}


def test_no_limit_and_unknown_allocatable_skips_high() -> None:
    assert unified("reclaimed_cores", c=ctr(limit=None), allocatable=0) == {}


def test_a_limit_of_0_is_no_limit() -> None:
    """A pod spec may say `limits.memory: "0"`, which kubelet and the runtime read as no limit
    (the pod watch passes the 0 on): no memory.high of 0, which would stall the container."""
    no_limit = {"memory.high": str(8 * GI * 95 // 100 // 4096 * 4096)}
    assert unified("reclaimed_cores", c=ctr(limit=0, request=None)) == no_limit
    assert unified("reclaimed_cores", c=ctr(limit=0, request=None), allocatable=0) == {}
    skip = with_level("reclaimed_cores", policy="ratios", high_ratio=95, no_limit="skip")
    assert unified("reclaimed_cores", cfg=skip, c=ctr(limit=0, request=None)) == {}
    kubernetes = with_level("shared_cores", policy="kubernetes")
    assert unified("shared_cores", cfg=kubernetes, c=ctr(limit=0, request=None)) == {
        "memory.high": "7730937856"}   # 0.9 x 8 GiB of allocatable
    # The annotation's highRatio is of the allocatable too.
    p = pod({VOLCANO_ANNOTATION: '{"memoryQos":{"highRatio":50}}'})
    assert unified("shared_cores", p=p, c=ctr(limit=0, request=None)) == {
        "memory.high": str(4 * GI)}


def test_a_request_of_0_is_no_request() -> None:
    """Kubernetes counts a request of 0 as none: min/low are not set, as without a request."""
    for level in ("dedicated_cores", "shared_cores"):
        assert unified(level, c=ctr(request=0)) == unified(level, c=ctr(request=None)) == {}


def test_a_level_never_writes_a_memory_high_of_0() -> None:
    """The Kubernetes formula with throttling_factor 0 gives 0 for a container without a
    request, as a ratio does of a limit below a page: no memory.high then, as kubelet does."""
    cfg = with_level("shared_cores", policy="kubernetes", throttling_factor=0.0)
    assert unified("shared_cores", cfg=cfg, c=ctr(request=None)) == {}
    assert unified("shared_cores", cfg=cfg) == {"memory.high": str(256 * MI)}
    assert unified("reclaimed_cores", c=ctr(limit=4096, request=None)) == {}


def test_ratios_are_exact_at_any_size() -> None:
    """memory.min/low never above the request, memory.high never above the limit, to the byte,
    however large: a float product rounds up past them from about 80 TiB."""
    huge = (1 << 60) - 1
    cfg = with_level("shared_cores", policy="ratios", min_ratio=100, low_ratio=100,
                     high_ratio=100)
    out = unified("shared_cores", cfg=cfg, c=ctr(limit=huge, request=huge))
    assert out == {key: str(huge // 4096 * 4096)
                   for key in ("memory.high", "memory.low", "memory.min")}
    # On cgroup v1 the reservation stays an int64 (the runtime's field) at the largest request.
    int64_max = (1 << 63) - 1
    v1 = with_level("shared_cores", policy="ratios", low_ratio=100, v1_reservation=True)
    d = memory_settings(pod(), ctr(limit=None, request=int64_max), "shared_cores", v1,
                        cgroup_v2=False, node_allocatable=0)
    assert d.settings.memory_reservation == int64_max // 4096 * 4096


def test_high_never_below_low() -> None:
    cfg = with_level("shared_cores", policy="ratios", low_ratio=100, high_ratio=10)
    out = unified("shared_cores", cfg=cfg, c=ctr(limit=512 * MI, request=512 * MI))
    assert out["memory.high"] == out["memory.low"] == str(512 * MI)


def test_page_size_rounding() -> None:
    cfg = dataclasses.replace(with_level("shared_cores", policy="ratios", high_ratio=33),
                              page_size=65536)
    high = int(unified("shared_cores", cfg=cfg)["memory.high"])
    assert high % 65536 == 0
    assert high <= 512 * MI * 0.33 < high + 65536


# --- Volcano annotation ----------------------------------------------------------------------

def test_volcano_annotation_overrides_ratios() -> None:
    p = pod({VOLCANO_ANNOTATION: '{"selector":{"matchLabels":{"a":"b"}},'
                                 '"memoryQos":{"highRatio":80,"lowRatio":50,"minRatio":25}}'})
    assert unified("shared_cores", p=p) == {
        "memory.high": str(int(512 * MI * 0.8) // 4096 * 4096),
        "memory.low": str(128 * MI), "memory.min": str(64 * MI)}


def test_volcano_defaults_for_missing_ratios() -> None:
    p = pod({VOLCANO_ANNOTATION: '{"memoryQos":{"lowRatio":50}}'})
    assert unified("shared_cores", p=p) == {
        "memory.high": str(512 * MI), "memory.low": str(128 * MI), "memory.min": "0"}


def test_volcano_without_memory_qos_changes_nothing() -> None:
    p = pod({VOLCANO_ANNOTATION: '{"selector":{}}'})
    assert unified("shared_cores", p=p) == unified("shared_cores") == {
        "memory.low": str(256 * MI)}
    assert unified("shared_cores", cfg=with_level("shared_cores"), p=p) == {}


def test_empty_annotation_resets() -> None:
    p = pod({VOLCANO_ANNOTATION: ""})
    assert unified("shared_cores", cfg=with_level("shared_cores"), p=p) == {
        "memory.high": "max", "memory.low": "0", "memory.min": "0"}
    # The default online level's protection stays: the level sets memory.low.
    assert unified("shared_cores", p=p) == {
        "memory.high": "max", "memory.low": str(256 * MI), "memory.min": "0"}
    # The level's own policy still holds: a reset never lifts the admin's throttling.
    assert unified("reclaimed_cores", p=pod({VOLCANO_ANNOTATION: "  "})) == {
        "memory.high": "510025728", "memory.low": "0", "memory.min": "0"}


def test_annotation_ignored_when_disabled() -> None:
    cfg = dataclasses.replace(with_level("shared_cores"), volcano_annotation=False)
    assert unified("shared_cores", cfg=cfg, p=pod({VOLCANO_ANNOTATION: ""})) == {}


def test_reclaimed_pod_cannot_protect_its_memory() -> None:
    p = pod({VOLCANO_ANNOTATION: '{"memoryQos":{"minRatio":100,"lowRatio":100}}'})
    d = memory_settings(p, ctr(), "reclaimed_cores", CFG, cgroup_v2=True, node_allocatable=0)
    # Nor lift the level's throttle (95 % of the limit) with Volcano's default highRatio.
    assert dict(d.settings.unified) == {"memory.high": str(512 * MI * 95 // 100 // 4096 * 4096)}
    assert len(d.problems) == 2
    assert all("above the allowed 0 for reclaimed_cores" in p for p in d.problems)


@pytest.mark.parametrize(("text", "why"), [
    ("not json", "invalid JSON"),
    ("[]", "must be a JSON object"),
    ('"x"', "must be a JSON object"),
    ("{" * 20000, "longer than"),
    ('{"memoryQos": 5}', "memoryQos: must be an object"),
    ('{"memoryQos": {"highRatio": 101}}', "must be 0..100, got 101"),
    ('{"memoryQos": {"lowRatio": -1}}', "must be 0..100, got -1"),
    ('{"memoryQos": {"minRatio": 100000000000000000000}}', "must be 0..100"),
    ('{"memoryQos": {"highRatio": 50.5}}', "must be an integer, got float"),
    ('{"memoryQos": {"highRatio": "50"}}', "must be an integer, got str"),
    ('{"memoryQos": {"highRatio": true}}', "must be an integer, got bool"),
    ('{"memoryQos": {"highRatio": null}}', "must be an integer"),
    ('{"memoryQos": {"swapRatio": 10}}', "unknown key 'swapRatio'"),
    ('{"memoryQos": {"../x": 10}}', "unknown key"),
])
def test_bad_volcano_annotations(text: str, why: str) -> None:
    ratios, problems = parse_volcano(text)
    assert ratios is None
    assert any(why in p for p in problems), problems
    # The level policy still applies; the annotation part is skipped and reported.
    d = memory_settings(pod({VOLCANO_ANNOTATION: text}), ctr(), "reclaimed_cores", CFG,
                        cgroup_v2=True, node_allocatable=0)
    assert dict(d.settings.unified) == {"memory.high": "510025728"}
    assert d.problems == problems


def test_parse_volcano_case_insensitive() -> None:
    expected = (Ratios(70, 0, 0, high_given=True), ())
    assert parse_volcano('{"MemoryQos":{"HighRatio":70}}') == expected


# --- cgroup v1 -------------------------------------------------------------------------------

def test_v1_emits_no_unified_keys() -> None:
    d = memory_settings(pod(), ctr(), "reclaimed_cores", CFG, cgroup_v2=False,
                        node_allocatable=0)
    assert d.settings.is_empty()


def test_v1_reservation_only_when_asked() -> None:
    cfg = with_level("shared_cores", policy="ratios", low_ratio=50, v1_reservation=True)
    d = memory_settings(pod(), ctr(), "shared_cores", cfg, cgroup_v2=False, node_allocatable=0)
    assert d.settings.memory_reservation == 128 * MI
    assert d.settings.memory_limit is None
    assert not d.settings.unified


def test_level_defaults_are_documented_levels() -> None:
    assert CFG.levels["reclaimed_cores"] == MemoryLevel(
        policy="ratios", high_ratio=95, annotation_max_min_ratio=0, annotation_max_low_ratio=0)


def test_annotation_may_throttle_harder_but_never_lift_the_level() -> None:
    level_high = str(512 * MI * 95 // 100 // 4096 * 4096)
    lifted = pod({VOLCANO_ANNOTATION: '{"memoryQos":{"highRatio":100}}'})
    d = memory_settings(lifted, ctr(), "reclaimed_cores", CFG, cgroup_v2=True,
                        node_allocatable=0)
    # min/low come from the annotation's (default) 0 ratios; high keeps the level's throttle.
    assert dict(d.settings.unified) == {"memory.high": level_high, "memory.low": "0",
                                        "memory.min": "0"}
    assert any("would lift memory.high" in p for p in d.problems)
    harder = pod({VOLCANO_ANNOTATION: '{"memoryQos":{"highRatio":50}}'})
    d = memory_settings(harder, ctr(), "reclaimed_cores", CFG, cgroup_v2=True,
                        node_allocatable=0)
    assert dict(d.settings.unified) == {"memory.high": str(256 * MI), "memory.low": "0",
                                        "memory.min": "0"}
    assert d.problems == ()


def test_annotation_protection_never_lifts_the_level_throttle() -> None:
    # shared_cores throttled at 50 % of the limit by the admin; a pod asking memory.low = its
    # whole request gets memory.low lowered to memory.high, not memory.high raised.
    level = MemoryLevel(policy="ratios", high_ratio=50)
    cfg = dataclasses.replace(CFG, levels=frozen_map({**CFG.levels, "shared_cores": level}))
    container = ContainerInfo("c", "s", "n", memory_limit=4 << 30, memory_request=4 << 30)
    plain = memory_settings(pod(), container, "shared_cores", cfg, cgroup_v2=True,
                            node_allocatable=0)
    assert dict(plain.settings.unified) == {"memory.high": str(2 << 30)}
    greedy = pod({VOLCANO_ANNOTATION: '{"memoryQos":{"highRatio":50,"lowRatio":100}}'})
    d = memory_settings(greedy, container, "shared_cores", cfg, cgroup_v2=True,
                        node_allocatable=0)
    assert d.settings.unified["memory.high"] == str(2 << 30)
    assert d.settings.unified["memory.low"] == str(2 << 30)
    assert any("memory.low" in p for p in d.problems)
