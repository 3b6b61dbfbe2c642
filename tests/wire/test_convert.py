"""Protobuf <-> plain views: what the policies see and what the runtime gets back."""

from __future__ import annotations

import sys

import pytest

from hooks.model import MAX_LABEL_CHARS, ReadKeys
from hooks.settings import ContainerSettings, HookStage, OciHookSpec
from nri_plugin.wire.convert import (
    MAX_CONTAINER_BYTES,
    MAX_POD_BYTES,
    ConvertedPod,
    container_info,
    convert_pod,
    fill_adjustment,
)
from nri_plugin.wire.errors import MessageError
from nri_plugin.wire.runtime_support import ClosField
from protos import nri_api_pb2 as api


def to_adjustment(settings: ContainerSettings, *, clos_field: ClosField | None
                  ) -> api.ContainerAdjustment:
    adjust = api.ContainerAdjustment()
    fill_adjustment(adjust, settings, clos_field=clos_field)
    return adjust


def test_pod_info() -> None:
    pod = api.PodSandbox(id="sb", uid="u1", name="web", namespace="shop",
                         labels={"app": "web"}, annotations={"a/b": "c"})
    pod.linux.cgroup_parent = "/kubepods/besteffort/podu1"
    pod.linux.cgroups_path = "/kubepods/besteffort/podu1/sb"
    info = convert_pod(pod).info
    assert (info.id, info.uid, info.name, info.namespace) == ("sb", "u1", "web", "shop")
    assert dict(info.labels) == {"app": "web"}
    assert dict(info.annotations) == {"a/b": "c"}
    assert info.cgroup_parent == "/kubepods/besteffort/podu1"
    assert info.cgroups_path == "/kubepods/besteffort/podu1/sb"
    with pytest.raises(TypeError):
        info.annotations["x"] = "y"  # type: ignore[index]


def test_pod_without_id_is_invalid() -> None:
    with pytest.raises(MessageError, match="no id"):
        convert_pod(api.PodSandbox(uid="u"))


def container_with(**resources: object) -> api.Container:
    container = api.Container(id="c1", pod_sandbox_id="sb", name="app", pid=42)
    container.linux.cgroups_path = "/kubepods/podu1/c1"
    memory = container.linux.resources.memory
    if "limit" in resources:
        memory.limit.value = resources["limit"]  # type: ignore[assignment]
    if "reservation" in resources:
        memory.reservation.value = resources["reservation"]  # type: ignore[assignment]
    if "memory_min" in resources:
        container.linux.resources.unified["memory.min"] = resources["memory_min"]  # type: ignore[assignment]
    if "oom" in resources:
        container.linux.oom_score_adj.value = resources["oom"]  # type: ignore[assignment]
    return container


def test_container_info_fields() -> None:
    info = container_info(container_with(limit=512 << 20, reservation=128 << 20, oom=-997))
    assert (info.id, info.pod_sandbox_id, info.name, info.pid) == ("c1", "sb", "app", 42)
    assert info.cgroups_path == "/kubepods/podu1/c1"
    assert info.memory_limit == 512 << 20
    assert info.memory_request == 128 << 20
    assert info.oom_score_adj == -997


def test_container_without_limits() -> None:
    info = container_info(container_with(limit=0))
    assert (info.memory_limit, info.memory_request, info.oom_score_adj) == (None, None, None)
    assert container_info(container_with()).memory_limit is None


def test_memory_min_preferred_over_reservation() -> None:
    assert container_info(container_with(memory_min="1048576",
                                         reservation=5)).memory_request == 1 << 20
    # Unusable memory.min falls back to the reservation.
    assert container_info(container_with(memory_min="max",
                                         reservation=7)).memory_request == 7


def test_container_without_id_is_invalid() -> None:
    with pytest.raises(MessageError):
        container_info(api.Container(name="x"))


SETTINGS = ContainerSettings(
    rdt_class="nriqos-reclaimed_cores",
    unified={"memory.high": "1000"},
    memory_limit=1 << 30,
    memory_reservation=1 << 20,
    oom_score_adj=1000,
    hooks=(OciHookSpec(HookStage.PRESTART, "/bin/hook", ("hook", "x"), ("A=1",), 5),
           OciHookSpec(HookStage.POSTSTOP, "/bin/done")),
    annotations={"qos.nri-qos.io/applied": "yes"},
)


def test_adjustment_with_rdt_class() -> None:
    adjust = to_adjustment(SETTINGS, clos_field="rdt_class")
    resources = adjust.linux.resources
    assert resources.rdt_class.value == "nriqos-reclaimed_cores"
    assert not adjust.linux.HasField("rdt")
    assert dict(resources.unified) == {"memory.high": "1000"}
    assert resources.memory.limit.value == 1 << 30
    assert resources.memory.reservation.value == 1 << 20
    assert adjust.linux.oom_score_adj.value == 1000
    assert dict(adjust.annotations) == {"qos.nri-qos.io/applied": "yes"}
    prestart = adjust.hooks.prestart[0]
    assert (prestart.path, list(prestart.args), list(prestart.env), prestart.timeout.value) == (
        "/bin/hook", ["hook", "x"], ["A=1"], 5)
    poststop = adjust.hooks.poststop[0]
    assert poststop.path == "/bin/done"
    assert not poststop.HasField("timeout")


def test_adjustment_with_clos_id_or_none() -> None:
    adjust = to_adjustment(SETTINGS, clos_field="clos_id")
    assert adjust.linux.rdt.clos_id.value == "nriqos-reclaimed_cores"
    assert not adjust.linux.resources.HasField("rdt_class")
    dropped = to_adjustment(SETTINGS, clos_field=None)
    assert not dropped.linux.HasField("rdt")
    assert not dropped.linux.resources.HasField("rdt_class")


def test_empty_settings_make_an_empty_adjustment() -> None:
    assert to_adjustment(ContainerSettings(), clos_field="clos_id").ByteSize() == 0


@pytest.mark.parametrize("text", ["²", "-5", "0", "9" * 25, "1e9", " 12x"])
def test_memory_min_that_is_not_a_plain_int64_gives_no_request(text: str) -> None:
    container = api.Container(id="c", pod_sandbox_id="s", name="n")
    container.linux.resources.unified["memory.min"] = text
    assert container_info(container).memory_request is None


def test_memory_min_becomes_the_request() -> None:
    container = api.Container(id="c", pod_sandbox_id="s", name="n")
    container.linux.resources.unified["memory.min"] = " 268435456 "
    assert container_info(container).memory_request == 256 << 20


@pytest.mark.parametrize(("text", "high"), [
    (" 268435456 ", "268435456"), ("max", "max"), ("0", "0"), ("²", None), ("-5", None),
    ("9" * 25, None), ("1e9", None), ("MAX", None), ("", None),
])
def test_kubelets_memory_high_is_taken_as_max_or_a_plain_int64(text: str,
                                                               high: str | None) -> None:
    container = api.Container(id="c", pod_sandbox_id="s", name="n")
    container.linux.resources.unified["memory.high"] = text
    assert container_info(container).memory_high == high


def test_no_memory_high_in_the_spec_is_none() -> None:
    assert container_info(api.Container(id="c", pod_sandbox_id="s", name="n")).memory_high \
        is None


def strings_size(*strings: str) -> int:
    return sum(sys.getsizeof(s) for s in strings)


@pytest.mark.parametrize("extra", [0, 1])
def test_pod_byte_limit_at_its_exact_value(extra: int) -> None:
    keys = ReadKeys(frozenset({"a", "b"}), labels=frozenset({"tier"}))
    first, parent = "x" * 16000, "/kubepods/besteffort/podu"
    fixed = strings_size("sb", "u", "web", "shop", parent, "", "a", first, "b", "", "tier", "t")
    second = "y" * (MAX_POD_BYTES - fixed + extra)
    pod = api.PodSandbox(id="sb", uid="u", name="web", namespace="shop",
                         labels={"tier": "t"},
                         annotations={"a": first, "b": second, "unread": "z" * 100_000})
    pod.linux.cgroup_parent = parent
    converted = convert_pod(pod, keys)
    if extra:
        # Kept as if it carried no annotation or label at all; its identity and cgroups stay.
        assert converted == ConvertedPod(
            convert_pod(pod, ReadKeys(frozenset())).info, ("a", "b", "label tier"),
            f"with its annotations and labels the pod would take {MAX_POD_BYTES + 1} bytes, "
            f"more than {MAX_POD_BYTES}: it is treated as if it carried none")
        assert (converted.info.annotations, converted.info.labels) == ({}, {})
        assert converted.info.cgroup_parent == parent
    else:
        assert converted.ignored == ()
        assert dict(converted.info.annotations) == {"a": first, "b": second}
        assert dict(converted.info.labels) == {"tier": "t"}


@pytest.mark.parametrize("extra", [0, 1])
def test_pod_refused_only_when_its_own_strings_are_over_the_byte_limit(extra: int) -> None:
    # Each string within its own limit; non-ASCII, so that they can add up to the pod's.
    pod = api.PodSandbox(id="sb", uid="u", namespace="shop", annotations={"a": "1"})
    pod.linux.cgroup_parent = "\U0001f600" * 4096
    pod.linux.cgroups_path = "\U0001f600" * 1720
    # Measured as read back: handing a string to protobuf caches its UTF-8 in it, and grows it.
    fixed = strings_size(pod.id, pod.uid, pod.namespace, pod.linux.cgroup_parent,
                         pod.linux.cgroups_path, "")
    pod.name = "n" * (MAX_POD_BYTES - fixed + extra)
    if extra:
        with pytest.raises(MessageError, match=f"ids, names and cgroup paths would take "
                                               f"{MAX_POD_BYTES + 1} bytes, more than "
                                               f"{MAX_POD_BYTES}"):
            convert_pod(pod)
    else:
        # At the limit the pod is kept, without the annotation that would take it over.
        assert convert_pod(pod).ignored == ("a",)


@pytest.mark.parametrize("extra", [0, 1])
def test_container_byte_limit_at_its_exact_value(extra: int) -> None:
    fixed = strings_size("c1", "sb", "app", "")
    container = api.Container(id="c1", pod_sandbox_id="sb", name="app")
    container.linux.cgroups_path = "/" * (MAX_CONTAINER_BYTES - fixed + extra)
    if extra:
        with pytest.raises(MessageError, match=f"more than {MAX_CONTAINER_BYTES}"):
            container_info(container)
    else:
        assert len(container_info(container).cgroups_path) == MAX_CONTAINER_BYTES - fixed


def test_only_the_labels_and_annotations_read_are_kept() -> None:
    keys = ReadKeys(frozenset({"qos"}), labels=frozenset({"tier"}))
    pod = api.PodSandbox(id="sb", uid="u", name="web", namespace="shop",
                         labels={"tier": "t" * 400, "app": "web"},
                         annotations={"qos": "be", "other": "x"})
    info = convert_pod(pod, keys).info
    assert dict(info.annotations) == {"qos": "be"}
    # A label value longer than Kubernetes allows is kept cut to one character more.
    assert dict(info.labels) == {"tier": "t" * (MAX_LABEL_CHARS + 1)}
