"""``nri-qos-hook``: the OCI hook executable injected into containers.

``nri-qos-hook resctrl-join --root /sys/fs/resctrl --group NAME [--target monitor|group]
[--strict]`` runs as a prestart hook: it reads the OCI state JSON on stdin and writes the
container's ``pid`` into ``<root>/NAME/mon_groups/NAME/tasks`` (``--target monitor``, the default)
or ``<root>/NAME/tasks`` (``--target group``).

A broken hook must not kill pods: on any error it explains on stderr and exits 0, unless
``--strict`` is given (exit 1, and the runtime fails the container).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import IO, NoReturn

from common import jsondoc
from hooks.resctrl_groups import valid_group_name
from hooks.untrusted import bounded, bounded_repr
from reconciler.host.sysfs import SysFs, SysPathError

MAX_STATE_BYTES = 1 << 20


class HookError(Exception):
    """Anything that keeps the hook from doing its job."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise HookError(f"usage: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nri-qos-hook", description="OCI hooks of nri-qos.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    join = commands.add_parser("resctrl-join", help="put the container's pid into a resctrl group")
    join.add_argument("--root", required=True, help="resctrl mount point (absolute)")
    join.add_argument("--group", required=True, help="control group name")
    join.add_argument("--target", choices=("monitor", "group"), default="monitor",
                      help="the group's monitor group (default) or the control group itself")
    join.add_argument("--strict", action="store_true", help="exit 1 on any error")
    return parser


def read_pid(stream: IO[bytes]) -> int:
    """The ``pid`` of an OCI state document."""
    data = stream.read(MAX_STATE_BYTES + 1)
    if len(data) > MAX_STATE_BYTES:
        raise HookError(f"OCI state larger than {MAX_STATE_BYTES} bytes")
    try:
        state = jsondoc.loads(data)
    except ValueError as exc:
        raise HookError(f"OCI state is not JSON: {exc}") from exc
    if not isinstance(state, dict):
        raise HookError("OCI state is not a JSON object")
    pid = state.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 1 << 31:
        raise HookError(f"OCI state has no valid pid: {bounded(repr(pid))}")
    return pid


def tasks_path(root: str, group: str, target: str) -> str:
    if not root.startswith("/") or ".." in root.split("/"):
        raise HookError(f"--root must be an absolute path without '..', got {bounded_repr(root)}")
    if not valid_group_name(group):
        raise HookError(f"--group is not a valid group name: {bounded_repr(group)}")
    base = f"{root.rstrip('/')}/{group}"
    if target == "monitor":
        base = f"{base}/mon_groups/{group}"
    return f"{base}/tasks"


def join(sysfs: SysFs, root: str, group: str, target: str, pid: int) -> None:
    path = tasks_path(root, group, target)
    try:
        written = sysfs.append_ids(path, [pid])
    except (OSError, SysPathError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise HookError(f"{path}: {why}") from exc
    if not written:
        raise HookError(f"{path}: writing pid {pid}: the process is gone")


def run(argv: Sequence[str], stdin: IO[bytes], stderr: IO[str], sysfs: SysFs) -> int:
    strict = "--strict" in argv
    try:
        args = _parser().parse_args(list(argv))
        strict = args.strict
        join(sysfs, args.root, args.group, args.target, read_pid(stdin))
    except HookError as exc:
        print(f"nri-qos-hook: {exc}", file=stderr)
        return 1 if strict else 0
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # The runtime runs the hook in the host's mount namespace: paths are the host's.
    return run(sys.argv[1:] if argv is None else argv, sys.stdin.buffer, sys.stderr, SysFs("/"))


if __name__ == "__main__":
    sys.exit(main())
