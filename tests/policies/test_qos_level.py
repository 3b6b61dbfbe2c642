"""QoS level resolution: each source, precedence, cgroup parents of both drivers, bad values."""

from __future__ import annotations

import dataclasses

import pytest

from hooks.config_fields import frozen_map
from hooks.model import PodInfo
from hooks.qos_level import LevelDecision, QosConfig, kubernetes_qos_class, resolve_level
from tests.support.builders import UID, pod

SD_UID = UID.replace("-", "_")

OURS = "qos.nri-qos.io/level"
KATALYST = "katalyst.kubewharf.io/qos_level"
KOORD = "koordinator.sh/qosClass"
VOLCANO = "volcano.sh/qos-level"


CFG = QosConfig()


@pytest.mark.parametrize(
    ("parent", "expected"),
    [
        # cgroupfs driver
        (f"/kubepods/besteffort/pod{UID}", "besteffort"),
        (f"/kubepods/burstable/pod{UID}", "burstable"),
        (f"/kubepods/pod{UID}", "guaranteed"),
        (f"kubepods/burstable/pod{UID}/", "burstable"),
        (f"/custom-root/kubepods/besteffort/pod{UID}", "besteffort"),
        (f"/kubepods/burstable/pod{UID}/0123abcd", "burstable"),
        # systemd driver, bare slice and full path
        (f"kubepods-besteffort-pod{SD_UID}.slice", "besteffort"),
        (f"kubepods-burstable-pod{SD_UID}.slice", "burstable"),
        (f"kubepods-pod{SD_UID}.slice", "guaranteed"),
        (f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SD_UID}.slice",
         "besteffort"),
        (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SD_UID}.slice",
         "burstable"),
        (f"/kubepods.slice/kubepods-pod{SD_UID}.slice", "guaranteed"),
        # a container's systemd cgroups path
        (f"kubepods-besteffort-pod{SD_UID}.slice:cri-containerd:0123abcd", "besteffort"),
        # not a pod cgroup
        ("", None),
        ("   ", None),
        ("/", None),
        ("/kubepods", None),
        ("/kubepods/besteffort", None),
        ("/kubepods/besteffort/", None),
        ("/kubepods/besteffort/notapod", None),
        ("/kubepods/unknownclass/pod123", None),
        ("kubepods.slice/kubepods-besteffort.slice", None),
        ("kubepods-besteffort.slice", None),
        ("/system.slice/containerd.service", None),
        ("kubepods-besteffort-pod.slice.extra", None),
        ("\x00\xff garbage ☃", None),
    ],
)
def test_kubernetes_qos_class(parent: str, expected: str | None) -> None:
    assert kubernetes_qos_class(parent) == expected


@pytest.mark.parametrize(
    ("p", "level", "source"),
    [
        (pod({OURS: "reclaimed_cores"}), "reclaimed_cores", "annotation"),
        (pod({OURS: "  system_cores\n"}, namespace="kube-system"), "system_cores", "annotation"),
        (pod({KATALYST: "dedicated_cores"}), "dedicated_cores", "katalyst"),
        (pod(labels={KOORD: "LSE"}), "dedicated_cores", "koordinator"),
        (pod(labels={KOORD: "LSR"}), "dedicated_cores", "koordinator"),
        (pod(labels={KOORD: "LS"}), "shared_cores", "koordinator"),
        (pod(labels={KOORD: "BE"}), "reclaimed_cores", "koordinator"),
        (pod(labels={KOORD: "SYSTEM"}, namespace="kube-system"), "system_cores", "koordinator"),
        (pod({KOORD: "BE"}), "reclaimed_cores", "koordinator"),
        (pod(labels={KOORD: "be"}), "reclaimed_cores", "koordinator"),
        (pod(labels={KOORD: " Lse "}), "dedicated_cores", "koordinator"),
        (pod({VOLCANO: "LC"}), "dedicated_cores", "volcano"),
        (pod({VOLCANO: "HLS"}), "dedicated_cores", "volcano"),
        (pod({VOLCANO: "LS"}), "shared_cores", "volcano"),
        (pod({VOLCANO: "BE"}), "reclaimed_cores", "volcano"),
        (pod({VOLCANO: "be"}), "reclaimed_cores", "volcano"),
        (pod(cgroup_parent=f"/kubepods/besteffort/pod{UID}"), "reclaimed_cores", "kubernetes_qos"),
        (pod(cgroup_parent=f"/kubepods/burstable/pod{UID}"), "shared_cores", "kubernetes_qos"),
        (pod(cgroup_parent=f"/kubepods/pod{UID}"), "shared_cores", "kubernetes_qos"),
        (pod(cgroup_parent=f"kubepods-besteffort-pod{SD_UID}.slice"), "reclaimed_cores",
         "kubernetes_qos"),
        (pod(), "shared_cores", "default"),
    ],
)
def test_each_source(p: PodInfo, level: str, source: str) -> None:
    assert resolve_level(p, CFG) == LevelDecision(level, source, ())


ALL_SOURCES = pod(
    {OURS: "system_cores", KATALYST: "dedicated_cores", KOORD: "LS", VOLCANO: "BE"},
    labels={KOORD: "SYSTEM"},
    # No Kubernetes class and a namespace that may claim system_cores: only the order decides.
    namespace="kube-system",
)


@pytest.mark.parametrize(
    ("sources", "level", "source"),
    [
        (("annotation", "katalyst", "koordinator", "volcano", "kubernetes_qos"),
         "system_cores", "annotation"),
        (("katalyst", "annotation"), "dedicated_cores", "katalyst"),
        (("koordinator", "annotation"), "system_cores", "koordinator"),  # label beats annotation
        (("volcano", "koordinator"), "reclaimed_cores", "volcano"),
        (("kubernetes_qos", "annotation"), "system_cores", "annotation"),
        ((), "shared_cores", "default"),
    ],
)
def test_precedence_follows_configured_order(
    sources: tuple[str, ...], level: str, source: str
) -> None:
    cfg = dataclasses.replace(CFG, sources=sources)
    assert resolve_level(ALL_SOURCES, cfg) == LevelDecision(level, source, ())


def test_default_order_stops_at_first_known_value() -> None:
    p = pod({KATALYST: "reclaimed_cores", VOLCANO: "LC"})
    assert resolve_level(p, CFG) == LevelDecision("reclaimed_cores", "katalyst", ())


def test_koordinator_annotation_used_when_label_absent() -> None:
    p = pod({KOORD: "LSR"}, labels={"app": "x"})
    assert resolve_level(p, CFG) == LevelDecision("dedicated_cores", "koordinator", ())


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        # level names are case-sensitive
        (pod({OURS: "Reclaimed_Cores", KATALYST: "reclaimed_cores"}),
         LevelDecision("reclaimed_cores", "katalyst", (("annotation", "Reclaimed_Cores"),))),
        (pod({OURS: "", VOLCANO: "LS"}),
         LevelDecision("shared_cores", "volcano", (("annotation", ""),))),
        (pod({KATALYST: "offline"}),
         LevelDecision("shared_cores", "default", (("katalyst", "offline"),))),
        # an unknown label falls through to the annotation of the same source
        (pod({KOORD: "BE"}, labels={KOORD: "XX"}),
         LevelDecision("reclaimed_cores", "koordinator", (("koordinator", "XX"),))),
        (pod({KOORD: "nope", VOLCANO: "??"}, labels={KOORD: "XX"},
             cgroup_parent=f"/kubepods/besteffort/pod{UID}"),
         LevelDecision("reclaimed_cores", "kubernetes_qos",
                       (("koordinator", "XX"), ("koordinator", "nope"), ("volcano", "??")))),
        # a cgroup parent that is not a pod cgroup is reported as it is
        (pod(cgroup_parent="/system.slice/foo"),
         LevelDecision("shared_cores", "default", (("kubernetes_qos", "/system.slice/foo"),))),
        (pod({OURS: "\x00\ufffd", KATALYST: "shared_cores\x00"}, cgroup_parent="   "),
         LevelDecision("shared_cores", "default",
                       (("annotation", "\x00\ufffd"), ("katalyst", "shared_cores\x00")))),
    ],
)
def test_unknown_values_fall_through_and_are_reported(p: PodInfo, expected: LevelDecision) -> None:
    assert resolve_level(p, CFG) == expected


def test_sources_not_configured_are_ignored() -> None:
    cfg = dataclasses.replace(CFG, sources=("volcano",))
    p = pod({OURS: "garbage", KATALYST: "dedicated_cores"})
    assert resolve_level(p, cfg) == LevelDecision("shared_cores", "default", ())


def test_mappings_and_default_come_from_config() -> None:
    cfg = dataclasses.replace(
        CFG,
        annotation="example.com/tier",
        default_level="reclaimed_cores",
        koordinator=frozen_map({"LS": "dedicated_cores"}),
        volcano=frozen_map({"lc": "system_cores"}),
        kubernetes_qos=frozen_map({"guaranteed": "dedicated_cores", "burstable": "shared_cores",
                                   "besteffort": "reclaimed_cores"}),
    )
    assert resolve_level(pod({"example.com/tier": "system_cores"}, namespace="kube-system"),
                         cfg).level == "system_cores"
    assert resolve_level(pod({OURS: "system_cores"}), cfg) == LevelDecision(
        "reclaimed_cores", "default", ()
    )
    assert resolve_level(pod(labels={KOORD: "ls"}), cfg).level == "dedicated_cores"
    assert resolve_level(pod(labels={KOORD: "BE"}), cfg) == LevelDecision(
        "reclaimed_cores", "default", (("koordinator", "BE"),)
    )
    assert resolve_level(pod({VOLCANO: "LC"}, namespace="kube-system"),
                         cfg).level == "system_cores"
    assert resolve_level(pod(cgroup_parent=f"/kubepods/pod{UID}"), cfg) == LevelDecision(
        "dedicated_cores", "kubernetes_qos", ()
    )


def test_unknown_source_name_is_a_programming_error() -> None:
    cfg = dataclasses.replace(CFG, sources=("astrology",))
    with pytest.raises(ValueError, match="astrology"):
        resolve_level(pod(), cfg)
