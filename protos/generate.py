"""Regenerate the checked-in modules (``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py``) from the
``.proto`` sources.

Usage::

    python -m protos.generate          # rewrite modules that differ from a fresh generation
    python -m protos.generate --check  # only compare; exit 1 and list the stale modules

The generated code depends on the exact grpcio-tools release (it embeds the protobuf version it
was built for), so the project pins grpcio-tools and this check keeps the modules in step.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_SOURCES = ("nri_api.proto", "ttrpc_envelope.proto", "eviction.proto")
GRPC_SOURCES = ("eviction.proto",)
"""Sources whose services are called over gRPC and so also get a ``*_pb2_grpc.py`` module (NRI's
services run over ttrpc, by hand)."""


# The gRPC module imports its message module as a top-level module; inside this package it must
# be a relative import.
_GRPC_IMPORT = re.compile(r"^import (?P<module>\w+_pb2) as (?P<alias>\w+)$", re.MULTILINE)

# protoc's stub writer escapes most Python keywords but not these, and upstream's ``Field`` enum
# has a value named ``None``: such an annotation is a syntax error in a ``.pyi`` file.
_KEYWORD_ANNOTATION = re.compile(
    r"^(?P<indent>[ \t]*)(?P<name>None|True|False): (?P<type>.+)$", re.MULTILINE
)


class GenerationError(RuntimeError):
    """protoc rejected the sources or produced no output."""


def generated_names(
    sources: Sequence[str] = PROTO_SOURCES, grpc_sources: Sequence[str] = GRPC_SOURCES
) -> list[str]:
    """Files protoc writes for ``sources``: ``x.proto`` gives ``x_pb2.py`` and ``x_pb2.pyi``,
    and ``x_pb2_grpc.py`` when it is one of ``grpc_sources``."""
    names: list[str] = []
    for source in sources:
        stem = source.removesuffix(".proto")
        names += [f"{stem}_pb2.py", f"{stem}_pb2.pyi"]
        if source in grpc_sources:
            names.append(f"{stem}_pb2_grpc.py")
    return names


def run_protoc(
    out_dir: Path, proto_dir: Path = PROTO_DIR, sources: Sequence[str] = PROTO_SOURCES,
    grpc_sources: Sequence[str] = GRPC_SOURCES,
) -> None:
    """Compile ``sources`` (names relative to ``proto_dir``) into ``out_dir``, with gRPC modules
    for ``grpc_sources``.

    protoc runs in a child interpreter: importing ``grpc_tools.protoc`` in-process would install
    its import hooks into the caller, and the module's command-line entry point already adds the
    bundled well-known types (``google/protobuf/any.proto``) to the include path.
    """
    proto_dir = proto_dir.resolve()
    base = [sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_dir}"]
    runs = [[*base, f"--python_out={out_dir}", f"--pyi_out={out_dir}",
             *(str(proto_dir / source) for source in sources)]]
    grpc_only = [source for source in sources if source in grpc_sources]
    if grpc_only:
        runs.append([*base, f"--grpc_python_out={out_dir}",
                     *(str(proto_dir / source) for source in grpc_only)])
    env = {**os.environ, "GRPC_PYTHON_DISABLE_DYNAMIC_STUBS": "1"}
    for command in runs:
        result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if result.returncode != 0:
            raise GenerationError(
                f"protoc failed with exit code {result.returncode}: {result.stderr.strip()}"
            )
    missing = [name for name in generated_names(sources, grpc_sources)
               if not (out_dir / name).is_file()]
    if missing:
        raise GenerationError(f"protoc did not produce: {', '.join(missing)}")


def fix_stub_keywords(stub: str) -> str:
    """Turn annotations whose target is a reserved word into comments so the stub parses.

    The value stays reachable at run time by name, e.g. ``Field.Value("None")``.
    """
    return _KEYWORD_ANNOTATION.sub(
        r'\g<indent># \g<name>: \g<type>  (reserved word; use .Value("\g<name>"))', stub
    )


def fix_grpc_imports(module: str) -> str:
    """``import x_pb2 as alias`` becomes ``from . import x_pb2 as alias``."""
    return _GRPC_IMPORT.sub(r"from . import \g<module> as \g<alias>", module)


def stale_modules(
    proto_dir: Path = PROTO_DIR, sources: Sequence[str] = PROTO_SOURCES, *, update: bool = False
) -> list[str]:
    """Names of generated modules in ``proto_dir`` that are missing or differ from fresh output.

    With ``update=True`` those modules are replaced by the fresh output; the returned names are
    then the ones that were rewritten.
    """
    stale: list[str] = []
    with tempfile.TemporaryDirectory(prefix="protos-gen-") as tmp:
        fresh_dir = Path(tmp)
        run_protoc(fresh_dir, proto_dir, sources)
        for name in generated_names(sources):
            fresh = fresh_dir / name
            if name.endswith(".pyi"):
                fresh.write_text(
                    fix_stub_keywords(fresh.read_text(encoding="utf-8")), encoding="utf-8"
                )
            elif name.endswith("_grpc.py"):
                fresh.write_text(
                    fix_grpc_imports(fresh.read_text(encoding="utf-8")), encoding="utf-8"
                )
            current = proto_dir / name
            if current.is_file() and current.read_bytes() == fresh.read_bytes():
                continue
            stale.append(name)
            if update:
                shutil.copyfile(fresh, current)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m protos.generate",
        description="Regenerate the Python modules from the .proto files in protos/.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write anything; exit 1 if a checked-in module is stale",
    )
    parser.add_argument(
        "--proto-dir",
        type=Path,
        default=PROTO_DIR,
        help="directory holding the .proto sources and generated modules (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    proto_dir: Path = args.proto_dir
    try:
        stale = stale_modules(proto_dir, update=not args.check)
    except GenerationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    verb = "stale" if args.check else "updated"
    for name in stale:
        print(f"{verb}: {proto_dir / name}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
