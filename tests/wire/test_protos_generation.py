"""The generated protobuf modules in step with their sources: regeneration, protoc errors, the
stubs, the gRPC modules, and the enums and field numbers kept from upstream."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from protos import generate
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as ttrpc

# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------


def copy_sources(dest: Path) -> None:
    for name in (*generate.PROTO_SOURCES, *generate.generated_names()):
        shutil.copyfile(generate.PROTO_DIR / name, dest / name)


def test_checked_in_modules_match_fresh_generation() -> None:
    assert generate.stale_modules() == []


def test_check_lists_stale_modules_and_regeneration_fixes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy_sources(tmp_path)
    edited = tmp_path / "nri_api_pb2.py"
    edited.write_text(edited.read_text() + "# local edit\n")
    (tmp_path / "ttrpc_envelope_pb2.pyi").unlink()

    assert generate.main(["--check", "--proto-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"stale: {tmp_path / 'nri_api_pb2.py'}",
        f"stale: {tmp_path / 'ttrpc_envelope_pb2.pyi'}",
    ]
    assert "local edit" in edited.read_text(), "--check must not write"

    assert generate.main(["--proto-dir", str(tmp_path)]) == 0
    assert generate.main(["--check", "--proto-dir", str(tmp_path)]) == 0
    assert edited.read_bytes() == (generate.PROTO_DIR / "nri_api_pb2.py").read_bytes()


def test_invalid_proto_source_gives_protoc_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy_sources(tmp_path)
    broken = tmp_path / "nri_api.proto"
    broken.write_text(broken.read_text().replace("string plugin_idx = 2;", "string plugin_idx;"))

    with pytest.raises(generate.GenerationError, match=r"protoc failed .*nri_api\.proto"):
        generate.stale_modules(tmp_path)
    assert generate.main(["--check", "--proto-dir", str(tmp_path)]) == 2
    assert "error: protoc failed" in capsys.readouterr().err


def test_stub_keywords_become_comments() -> None:
    stub = "class Field(int):\n    None: _ClassVar[Field]\n    Env: _ClassVar[Field]\nNone: Field\n"
    fixed = generate.fix_stub_keywords(stub)
    assert fixed.splitlines() == [
        "class Field(int):",
        '    # None: _ClassVar[Field]  (reserved word; use .Value("None"))',
        "    Env: _ClassVar[Field]",
        '# None: Field  (reserved word; use .Value("None"))',
    ]
    ast.parse(fixed)


@pytest.mark.parametrize("stub", ["nri_api_pb2.pyi", "ttrpc_envelope_pb2.pyi",
                                  "eviction_pb2.pyi"])
def test_checked_in_stubs_are_valid_python(stub: str) -> None:
    ast.parse((generate.PROTO_DIR / stub).read_text(), filename=stub)


def test_grpc_modules_only_for_grpc_services() -> None:
    names = generate.generated_names()
    assert [n for n in names if n.endswith("_grpc.py")] == ["eviction_pb2_grpc.py"]
    assert "nri_api_pb2_grpc.py" not in names  # NRI's services run over ttrpc


def test_grpc_module_imports_its_messages_from_the_package() -> None:
    fixed = generate.fix_grpc_imports("import grpc\nimport eviction_pb2 as eviction__pb2\n")
    assert fixed == "import grpc\nfrom . import eviction_pb2 as eviction__pb2\n"
    from protos import eviction_pb2_grpc

    assert vars(eviction_pb2_grpc)["eviction__pb2"].__name__ == "protos.eviction_pb2"
    assert hasattr(eviction_pb2_grpc, "EvictionPluginStub")


# ---------------------------------------------------------------------------
# Schema facts that do not need a recording
# ---------------------------------------------------------------------------


def test_field_enum_keeps_upstream_names() -> None:
    assert api.Field.Value("None") == 0
    assert api.Field.Name(36) == "LinuxSched"
    assert api.Field.Name(40) == "MemoryPolicy"
    assert max(api.Field.values()) == 40


def test_event_mask_bits_follow_enum_values() -> None:
    assert api.Event.Value("LAST") == 15
    assert api.Event.Value("VALIDATE_CONTAINER_ADJUSTMENT") == 14
    # bit (1 << (event - 1)); 0x7ff covers the eleven pod and container events
    all_eleven = sum(1 << (e - 1) for e in range(api.RUN_POD_SANDBOX, api.REMOVE_CONTAINER + 1))
    assert all_eleven == 0x7FF


def test_status_matches_google_rpc_status_wire_format() -> None:
    status = ttrpc.Status(code=12, message="method Nope")
    assert status.SerializeToString() == b"\x08\x0c\x12\x0bmethod Nope"
    # An OK status that is present on the wire is the empty message in field 1.
    assert ttrpc.Response(status=ttrpc.Status()).SerializeToString() == b"\x0a\x00"


def test_envelope_field_numbers() -> None:
    request = ttrpc.Request(
        service="s",
        method="m",
        payload=b"\x01",
        timeout_nano=1,
        metadata=[ttrpc.KeyValue(key="k", value="v")],
    )
    assert request.SerializeToString() == (
        b"\x0a\x01s\x12\x01m\x1a\x01\x01\x20\x01\x2a\x06\x0a\x01k\x12\x01v"
    )
    assert ttrpc.StringList(list=["a"]).SerializeToString() == b"\x0a\x01a"
