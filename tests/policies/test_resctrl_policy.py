"""resctrl policy: CBM / MB translation, group names, annotation parsing and bounds."""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType

import pytest

from hooks.config_fields import frozen_map
from hooks.levels import LEVEL_NAMES
from hooks.model import PodInfo
from hooks.resctrl import (
    Allocation,
    ResctrlInfo,
    Schemata,
    build_schemata,
    class_schemata,
    fit_mask,
    l3_mask,
    mb_value,
)
from hooks.resctrl_annotation import KOORDINATOR_ANNOTATION, parse_annotation, plan_pod_group
from hooks.resctrl_config import CacheOverride, ResctrlConfig, ResctrlLevel
from hooks.resctrl_groups import (
    GroupRef,
    class_group_name,
    parse_group_name,
    pod_group_name,
    valid_group_name,
)
from tests.support.builders import pod

INTEL = ResctrlInfo(num_closids=16, cbm_mask=0x7FF, min_cbm_bits=1, l3_ids=(0, 1), mb_ids=(0, 1),
                    mb_gran=10, mb_min=10, monitoring=True)
AMD = ResctrlInfo(num_closids=16, cbm_mask=0xFFFF, min_cbm_bits=1, l3_ids=(0, 1, 2, 3),
                  mb_ids=(0, 1, 2, 3), mb_gran=1, mb_min=0, mb_delay_linear=False,
                  mb_absolute=True, mb_max=2048)
CFG = ResctrlConfig()


# --- translation -----------------------------------------------------------------------------

@pytest.mark.parametrize(("start", "end", "info", "mask"), [
    (0, 100, INTEL, 0x7FF),
    (0, 30, INTEL, 0x00F),       # 3.3 ways rounded up to 4
    (20, 80, INTEL, 0x1FC),      # ways 2..8
    (0, 1, INTEL, 0x001),        # never below one way
    (99, 100, INTEL, 0x400),     # last way
    (50, 51, dataclasses.replace(INTEL, min_cbm_bits=2), 0x060),  # way 5, widened
    (99, 100, dataclasses.replace(INTEL, min_cbm_bits=2), 0x600),  # shifted to fit the mask
    (0, 100, AMD, 0xFFFF),
    (0, 50, AMD, 0x00FF),
    (50, 100, AMD, 0xFF00),
])
def test_l3_mask(start: int, end: int, info: ResctrlInfo, mask: int) -> None:
    got = l3_mask(start, end, info)
    assert got == mask
    assert got & ~info.cbm_mask == 0
    bits = bin(got)[2:].strip("0")
    assert set(bits) == {"1"}, "mask must be contiguous"
    assert len(bits) >= info.min_cbm_bits


def test_l3_mask_without_l3_is_an_error() -> None:
    with pytest.raises(ValueError, match="no L3"):
        l3_mask(0, 100, dataclasses.replace(INTEL, cbm_mask=0))


@pytest.mark.parametrize(("percent", "info", "value"), [
    (100, INTEL, 100),
    (20, INTEL, 20),
    (21, INTEL, 30),   # rounded up to the 10 % granularity
    (1, INTEL, 10),    # never below min_bandwidth
    (5, dataclasses.replace(INTEL, mb_min=20), 20),
    (100, AMD, 2048),  # absolute units
    (50, AMD, 1024),
    (1, AMD, 21),
])
def test_mb_value(percent: int, info: ResctrlInfo, value: int) -> None:
    assert mb_value(percent, info) == value


def test_schemata_lines() -> None:
    s = build_schemata(Allocation(l3=(0, 30), mb=20), INTEL)
    assert s.lines() == ("L3:0=f;1=f", "MB:0=20;1=20")


def test_class_schemata_from_config_with_per_cache_override() -> None:
    level = ResctrlLevel(l3_start_percent=0, l3_end_percent=30, mb_percent=50,
                         per_cache=frozen_map({"1": CacheOverride(0, 50, 30)}))
    assert class_schemata(level, INTEL).lines() == ("L3:0=f;1=3f", "MB:0=50;1=30")
    assert class_schemata(level, AMD).lines() == (
        "L3:0=1f;1=ff;2=1f;3=1f", "MB:0=1024;1=615;2=1024;3=1024")


def test_host_without_mb_gets_only_l3() -> None:
    info = dataclasses.replace(INTEL, mb_ids=())
    assert build_schemata(Allocation(mb=20), info).lines() == ("L3:0=7ff;1=7ff",)


# --- names -----------------------------------------------------------------------------------

def test_group_names_round_trip() -> None:
    uid = "3f1c2a9e-0b7d-4a51-9c1e-5d2f6a7b8c90"
    assert class_group_name("nriqos-", "reclaimed_cores") == "nriqos-reclaimed_cores"
    name = pod_group_name("nriqos-", uid)
    assert name == f"nriqos-pod-{uid}"
    assert parse_group_name("nriqos-", name, LEVEL_NAMES) == GroupRef("pod", uid)
    assert parse_group_name("nriqos-", "nriqos-shared_cores", LEVEL_NAMES) == GroupRef(
        "class", "shared_cores")
    assert parse_group_name("nriqos-", "other-shared_cores", LEVEL_NAMES) is None
    assert parse_group_name("nriqos-", "nriqos-unknown", LEVEL_NAMES) is None
    assert parse_group_name("nriqos-", "nriqos-pod-a/b", LEVEL_NAMES) is None


@pytest.mark.parametrize("uid", [
    "", "../etc", "a/b", "..", "a..b/c", "x" * 65, "uid with space", "uid\n", "ünï", "a_b",
    "a.b",
])
def test_bad_uids_never_become_names(uid: str) -> None:
    assert pod_group_name("nriqos-", uid) is None


@pytest.mark.parametrize(("name", "ok"), [
    ("nriqos-shared_cores", True), ("COS1", True), ("a.b", True),
    ("", False), ("..", False), ("a..b", False), ("a/b", False), (".hidden", False),
    ("info", False), ("mon_groups", False), ("tasks", False), ("x" * 201, False),
    ("a b", False), ("a\x00b", False),
])
def test_valid_group_name(name: str, ok: bool) -> None:
    assert valid_group_name(name) is ok


# --- annotation parsing ----------------------------------------------------------------------

def test_parse_recorded_koordinator_annotation() -> None:
    alloc, problems = parse_annotation(
        '{"LLC":{"schemata":{"range":[20,80]}},"MB":{"schemata":{"percent":20}}}')
    assert problems == ()
    assert alloc == Allocation(l3=(20, 80), mb=20)


def test_parse_per_cache_and_case_insensitive_keys() -> None:
    text = json.dumps({"llc": {"SchemataPerCache": [{"range": [0, 50]},
                                                     {"cacheID": 1, "percent": 30}]},
                       "mb": {"schemataPerCache": [{"cacheid": 1, "percent": 40}]}})
    alloc, problems = parse_annotation(text)
    assert problems == ()
    assert alloc is not None
    assert dict(alloc.l3_per_cache) == {0: (0, 50), 1: (0, 30)}
    assert dict(alloc.mb_per_cache) == {1: 40}


@pytest.mark.parametrize(("text", "why"), [
    ("not json", "invalid JSON"),
    ("", "invalid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ("42", "must be a JSON object"),
    ("null", "must be a JSON object"),
    ("[" * 100_000, "longer than"),
    ('{"L3": {}}', "unknown or duplicate key"),
    ('{"LLC": 5}', "LLC: must be an object"),
    ('{"LLC": {"schemata": {"range": [20, 80]}, "extra": 1}}', "unknown key 'extra'"),
    ('{"LLC": {"schemata": {"range": [20, 80], "mask": "ff"}}}', "unknown key 'mask'"),
    ('{"LLC": {"schemata": {"range": [80, 20]}}}', "end must be greater"),
    ('{"LLC": {"schemata": {"range": [20, 20]}}}', "end must be greater"),
    ('{"LLC": {"schemata": {"range": [-10, 20]}}}', "must be 0..99, got -10"),
    ('{"LLC": {"schemata": {"range": [0, 101]}}}', "must be 1..100, got 101"),
    ('{"LLC": {"schemata": {"range": [0, 1e3]}}}', "must be an integer, got float"),
    ('{"LLC": {"schemata": {"range": [0, 99999999999999999999999]}}}', "must be 1..100"),
    ('{"LLC": {"schemata": {"range": ["0", "50"]}}}', "must be an integer, got str"),
    ('{"LLC": {"schemata": {"range": [true, 50]}}}', "must be an integer, got bool"),
    ('{"LLC": {"schemata": {"range": [0, 50, 60]}}}', "must be [start, end]"),
    ('{"LLC": {"schemata": {"range": "0-50"}}}', "must be [start, end]"),
    ('{"LLC": {"schemata": {"percent": 0}}}', "must be 1..100, got 0"),
    ('{"LLC": {"schemata": {"percent": 20, "range": [0, 20]}}}', "not both"),
    ('{"LLC": {"schemataPerCache": {"cacheID": 0}}}', "must be a list"),
    ('{"LLC": {"schemataPerCache": [{"cacheID": -1, "percent": 20}]}}', "got -1"),
    ('{"LLC": {"schemataPerCache": [{"cacheID": "../0", "percent": 20}]}}', "must be an integer"),
    ('{"LLC": {"schemataPerCache": [{"cacheID": 1, "percent": 20}, '
     '{"cacheID": 1, "percent": 30}]}}', "given twice"),
    ('{"LLC": {"schemataPerCache": [{"cacheID": 0}]}}', "needs range or percent"),
    ('{"MB": {"schemata": {"percent": 150}}}', "must be 1..100, got 150"),
    ('{"MB": {"schemata": {"percent": -5}}}', "got -5"),
    ('{"MB": {"schemata": {"range": [0, 50]}}}', "MB takes a percent"),
    ('{"MB": {"schemata": {"percent": 2.5}}}', "must be an integer"),
    ('{"MB": {"schemata": {"percent": null}}}', "must be an integer"),
    ('{"MB": {"schemata": []}}', "must be an object"),
])
def test_bad_annotations_are_rejected(text: str, why: str) -> None:
    alloc, problems = parse_annotation(text)
    assert alloc is None
    assert any(why in p for p in problems), problems


def test_one_bad_part_keeps_the_other() -> None:
    alloc, problems = parse_annotation(
        '{"LLC":{"schemata":{"range":[80,20]}},"MB":{"schemata":{"percent":20}}}')
    assert alloc == Allocation(mb=20)
    assert len(problems) == 1
    assert "LLC" in problems[0]


def test_empty_parts_ask_for_nothing() -> None:
    assert parse_annotation('{"LLC": {}, "MB": {"schemata": {}}}') == (None, ())


# --- pod plans -------------------------------------------------------------------------------

def test_plan_for_recorded_annotation_on_shared_pod() -> None:
    p = pod({KOORDINATOR_ANNOTATION:
             '{"LLC":{"schemata":{"range":[20,80]}},"MB":{"schemata":{"percent":20}}}'})
    plan = plan_pod_group(p, "shared_cores", CFG, INTEL)
    assert plan.problems == ()
    assert plan.group == f"nriqos-pod-{p.uid}"
    assert plan.source == KOORDINATOR_ANNOTATION
    assert plan.schemata is not None
    assert plan.schemata.lines() == ("L3:0=1fc;1=1fc", "MB:0=20;1=20")


def test_own_annotation_wins_over_koordinator() -> None:
    p = pod({KOORDINATOR_ANNOTATION: '{"MB":{"schemata":{"percent":20}}}',
             CFG.annotation: '{"MB":{"schemata":{"percent":40}}}'})
    plan = plan_pod_group(p, "shared_cores", CFG, INTEL)
    assert plan.source == CFG.annotation
    assert plan.schemata == Schemata(MappingProxyType({0: 0x7FF, 1: 0x7FF}),
                                     MappingProxyType({0: 40, 1: 40}))


def test_no_annotation_no_pod_group() -> None:
    assert plan_pod_group(pod({}), "shared_cores", CFG, INTEL).group is None


def test_pod_groups_off_or_koordinator_off() -> None:
    p = pod({KOORDINATOR_ANNOTATION: '{"MB":{"schemata":{"percent":20}}}'})
    assert plan_pod_group(p, "shared_cores", dataclasses.replace(CFG, pod_groups=False),
                          INTEL).group is None
    assert plan_pod_group(p, "shared_cores",
                          dataclasses.replace(CFG, koordinator_annotation=False),
                          INTEL).group is None


def test_reclaimed_pod_cannot_leave_its_level_share() -> None:
    # reclaimed_cores class: L3 0..30 %; asking for 0..80 % is escalation.
    p = pod({CFG.annotation: '{"LLC":{"schemata":{"range":[0,80]}}}'})
    plan = plan_pod_group(p, "reclaimed_cores", CFG, INTEL)
    assert plan.group is None
    assert "outside the allowed [0, 30]" in plan.problems[0]
    ok = plan_pod_group(pod({CFG.annotation: '{"LLC":{"schemata":{"percent":20}}}'}),
                        "reclaimed_cores", CFG, INTEL)
    assert ok.schemata is not None
    assert ok.schemata.lines() == ("L3:0=7;1=7", "MB:0=100;1=100")


def test_admin_caps_bound_pods() -> None:
    cfg = dataclasses.replace(CFG, pod_l3_max_percent=50, pod_mb_max_percent=40)
    too_much = pod({CFG.annotation: '{"MB":{"schemata":{"percent":60}}}'})
    plan = plan_pod_group(too_much, "shared_cores", cfg, INTEL)
    assert plan.group is None
    assert "above the allowed 40" in plan.problems[0]
    # An MB-only request gets the capped L3 share, never the full cache.
    fine = plan_pod_group(pod({CFG.annotation: '{"MB":{"schemata":{"percent":30}}}'}),
                          "shared_cores", cfg, INTEL)
    assert fine.schemata is not None
    assert fine.schemata.lines() == ("L3:0=3f;1=3f", "MB:0=30;1=30")


def test_rejected_part_falls_back_to_the_level_share() -> None:
    cfg = dataclasses.replace(CFG, pod_mb_max_percent=40)
    p = pod({CFG.annotation: '{"LLC":{"schemata":{"range":[0,50]}},'
                             '"MB":{"schemata":{"percent":90}}}'})
    plan = plan_pod_group(p, "shared_cores", cfg, INTEL)
    assert plan.schemata is not None
    assert plan.schemata.lines() == ("L3:0=3f;1=3f", "MB:0=40;1=40")
    assert plan.problems
    assert all(p.startswith("MB: 90 %") for p in plan.problems)


def test_unknown_cache_id_is_rejected() -> None:
    p = pod({CFG.annotation: '{"LLC":{"schemataPerCache":[{"cacheID":7,"range":[0,50]}]}}'})
    plan = plan_pod_group(p, "shared_cores", CFG, INTEL)
    assert plan.group is None
    assert "no L3 cache id 7" in plan.problems[0]


def test_pod_with_bad_uid_gets_no_group() -> None:
    p = pod({CFG.annotation: '{"MB":{"schemata":{"percent":20}}}'}, uid="../../etc")
    plan = plan_pod_group(p, "shared_cores", CFG, INTEL)
    assert plan.group is None
    assert "not a uid" in plan.problems[-1]


def test_amd_pod_plan_uses_absolute_mb() -> None:
    p = pod({CFG.annotation: '{"MB":{"schemata":{"percent":25}}}'})
    plan = plan_pod_group(p, "shared_cores", CFG, AMD)
    assert plan.schemata is not None
    assert plan.schemata.lines()[1] == "MB:0=512;1=512;2=512;3=512"


def test_widening_to_min_cbm_bits_stays_inside_the_level() -> None:
    # 11 ways, at least 2 per mask: reclaimed_cores holds ways 0-3 (0xf). A request for the
    # top of that range is one way wide and must grow downwards, not into way 4.
    info = dataclasses.replace(INTEL, min_cbm_bits=2)
    annotation = json.dumps({"LLC": {"schemata": {"range": [29, 30]}}})
    pod = PodInfo("s", "11111111-2222-3333-4444-555555555555", "p", "ns",
                  annotations={"qos.nri-qos.io/resctrl": annotation})
    plan = plan_pod_group(pod, "reclaimed_cores", CFG, info)
    assert plan.schemata is not None
    level_mask = class_schemata(CFG.levels["reclaimed_cores"], info).l3[0]
    assert level_mask == 0xF
    for mask in plan.schemata.l3.values():
        assert mask & ~level_mask == 0
        assert mask.bit_count() == 2
        assert mask == 0xC


@pytest.mark.parametrize(("mask", "within", "fitted"), [
    (0b0011000, 0b0001111, 0b0001100),   # slid down into the range
    (0b0000011, 0b1111000, 0b0011000),   # slid up into the range
    (0b0000110, 0b0001111, 0b0000110),   # already inside: untouched
    (0b1111111, 0b0001111, 0b0001111),   # wider than the range: the range itself
])
def test_fit_moves_a_mask_without_widening(mask: int, within: int, fitted: int) -> None:
    assert fit_mask(mask, within) == fitted
