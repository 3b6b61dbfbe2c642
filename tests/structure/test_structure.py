"""The structure the code promises, checked on its source: who touches the host, and how.

* Only the host layer (``reconciler/host/``) names files under ``/sys`` or ``/proc``; everyone
  else goes through it. Config defaults (a ``setting(...)`` declaring where a filesystem is
  mounted) are the one exception: they are data handed to the host layer.
* Outside the host layer, files are opened only where the file is the agent's own (its
  configuration, its audit file, an OCI hook executable it checks), each listed here with why.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from tests.support.paths import REPO

PACKAGES = ("nri_plugin", "reconciler", "common", "hooks")
HOST_LAYER = REPO / "reconciler" / "host"
FILE_CALLS = {"open", "read_text", "write_text", "read_bytes", "write_bytes", "listdir",
              "scandir", "walk", "stat", "lstat", "exists", "isdir", "isfile", "mkdir", "rmdir",
              "unlink", "iterdir"}
# (module, call) pairs allowed outside the host layer, and why.
OWN_FILES = {
    ("nri_plugin/config/loader.py", "open"): "reads the configuration file",
    ("nri_plugin/config/loader.py", "listdir"): "lists the configuration's drop-in files",
    ("nri_plugin/cli/nri_qos.py", "open"): "points standard output at /dev/null once its reader "
                                           "left",
    ("nri_plugin/config/store.py", "stat"): "notices a changed configuration file",
    ("nri_plugin/config/store.py", "exists"): "falls back to the embedded defaults",
    ("nri_plugin/sim/simulator.py", "unlink"): "removes the simulated runtime's own socket",
    ("reconciler/eviction/remote.py", "listdir"): "lists the eviction plugins' socket directory",
    ("reconciler/eviction/remote.py", "lstat"): "checks who owns an eviction plugin's socket",
    ("nri_plugin/config/hook_paths.py", "lstat"): "checks an OCI hook executable and every "
                                                   "directory and link on its path",
    ("nri_plugin/obs/audit_sinks.py", "open"): "writes the audit file",
    ("nri_plugin/obs/audit_sinks.py", "exists"): "rotates the audit file",
    ("nri_plugin/report/status.py", "stat"): "removes only its own status socket",
    ("nri_plugin/report/status.py", "lstat"): "finds a status socket left behind",
    ("nri_plugin/report/status.py", "unlink"): "replaces a stale status socket, removes its own",
    ("nri_plugin/cli/reset.py", "lstat"): "finds the status socket an agent left behind",
    ("nri_plugin/cli/reset.py", "unlink"): "removes the status socket an agent left behind",
    ("nri_plugin/code_pages.py", "open"): "drops the cached pages of the agent's own code",
    ("reconciler/kube/kubeconfig.py", "open"): "reads the kubeconfig",
    ("reconciler/kube/credentials.py", "read_text"): "reads the API token for each request",
    ("reconciler/kube/transport.py", "open"): "hands a kubeconfig's client certificate to the "
                                              "TLS library through a private temporary file",
}


def modules() -> Iterator[tuple[str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.is_relative_to(HOST_LAYER) or path.name.endswith("_pb2.py"):
                continue
            yield str(path.relative_to(REPO)), ast.parse(path.read_text(), str(path))


def _docstrings(tree: ast.Module) -> set[int]:
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _setting_defaults(tree: ast.Module) -> set[int]:
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setting":
            found |= {id(n) for n in ast.walk(node) if isinstance(n, ast.Constant)}
    return found


def system_paths(tree: ast.Module) -> list[tuple[int, str]]:
    """String constants (f-string parts included) that name something under /sys or /proc."""
    skip = _docstrings(tree) | _setting_defaults(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in skip
            and (node.value.startswith(("/sys/", "/proc/")) or node.value in ("/sys", "/proc"))]


def test_only_the_host_layer_names_sys_and_proc() -> None:
    found = [f"{name}:{line}: {value!r}" for name, tree in modules()
             for line, value in system_paths(tree)]
    assert found == []


def test_files_are_opened_only_by_the_host_layer_or_for_the_agents_own_files() -> None:
    found = []
    for name, tree in modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            # A bare name is a file call only as the builtin open (a parameter named exists is
            # a predicate handed in, not file access).
            if called not in FILE_CALLS or (isinstance(func, ast.Name) and called != "open"):
                continue
            receiver = func.value if isinstance(func, ast.Attribute) else None
            # Method calls on our own objects that merely share a name (ClientStreams.open,
            # SysFs.read_bytes) are not file access: the host layer's objects are allowed.
            if isinstance(receiver, ast.Attribute) and receiver.attr in (
                    "_client_streams", "sysfs", "_sysfs"):
                continue
            if (name, called) not in OWN_FILES:
                found.append(f"{name}:{node.lineno}: {called}(...)")
    assert found == []


def test_the_checks_see_what_they_look_for() -> None:
    tree = ast.parse('"""/proc/ in a docstring is fine"""\n'
                     'x = setting("/sys/fs/resctrl", "doc")\n'
                     'y = open(f"/proc/{pid}/oom_score_adj")\n')
    assert system_paths(tree) == [(3, "/proc/")]
