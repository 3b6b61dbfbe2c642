"""The nri-qos-hook executable, run as the runtime runs it: a process with OCI state on stdin."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nri_plugin.cli.hook import run
from reconciler.host.sysfs import SysFs
from tests.support.paths import REPO
from tests.support.resctrl_trees import intel_tree

GROUP = "nriqos-pod-3f1c2a9e-0b7d-4a51-9c1e-5d2f6a7b8c90"


def oci_state(pid: object = 4242) -> bytes:
    """What runc writes to a hook's stdin (runtime-spec state)."""
    return json.dumps({
        "ociVersion": "1.2.0",
        "id": "2f6e5b8c0d1a",
        "status": "created",
        "pid": pid,
        "bundle": "/run/containerd/io.containerd.runtime.v2.task/k8s.io/2f6e5b8c0d1a",
        "annotations": {"io.kubernetes.cri.container-type": "container"},
    }).encode()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = intel_tree(tmp_path / "resctrl")
    mon = root / GROUP / "mon_groups" / GROUP
    mon.mkdir(parents=True)
    (root / GROUP / "tasks").write_text("")
    (mon / "tasks").write_text("")
    return root


def hook(args: list[str], stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "nri_plugin.cli.hook", *args], input=stdin,
                          capture_output=True, env=env, cwd=REPO, timeout=30, check=False)


def test_joins_the_monitor_group(tree: Path) -> None:
    done = hook(["resctrl-join", "--root", str(tree), "--group", GROUP], oci_state(4242))
    assert done.returncode == 0, done.stderr
    assert done.stderr == b""
    assert (tree / GROUP / "mon_groups" / GROUP / "tasks").read_text() == "4242\n"
    assert (tree / GROUP / "tasks").read_text() == ""


def test_joins_the_control_group(tree: Path) -> None:
    done = hook(["resctrl-join", "--root", str(tree), "--group", GROUP, "--target", "group"],
                oci_state(77))
    assert done.returncode == 0, done.stderr
    assert (tree / GROUP / "tasks").read_text() == "77\n"


BAD_CASES = [
    (["resctrl-join", "--root", "{root}", "--group", "../escape"], oci_state(), "valid group"),
    (["resctrl-join", "--root", "{root}", "--group", "a/b"], oci_state(), "valid group"),
    (["resctrl-join", "--root", "{root}", "--group", ".."], oci_state(), "valid group"),
    (["resctrl-join", "--root", "relative/dir", "--group", GROUP], oci_state(), "absolute"),
    (["resctrl-join", "--root", "{root}/../resctrl", "--group", GROUP], oci_state(), "'..'"),
    (["resctrl-join", "--root", "{root}", "--group", "nriqos-missing"], oci_state(),
     "No such file"),
    (["resctrl-join", "--root", "{root}"], oci_state(), "usage"),
    (["resctrl-join", "--root", "{root}", "--group", GROUP, "--target", "x"], oci_state(),
     "usage"),
    (["no-such-command"], oci_state(), "usage"),
    ([], oci_state(), "usage"),
    (["resctrl-join", "--root", "{root}", "--group", GROUP], b"not json", "not JSON"),
    (["resctrl-join", "--root", "{root}", "--group", GROUP], b"[1]", "not a JSON object"),
    (["resctrl-join", "--root", "{root}", "--group", GROUP], b"", "not JSON"),
    (["resctrl-join", "--root", "{root}", "--group", GROUP], oci_state(pid=0), "no valid pid"),
    (["resctrl-join", "--root", "{root}", "--group", GROUP], oci_state(pid=-5), "no valid pid"),
    (["resctrl-join", "--root", "{root}", "--group", GROUP], oci_state(pid="12"),
     "no valid pid"),
    (["resctrl-join", "--root", "{root}", "--group", GROUP], oci_state(pid=True),
     "no valid pid"),
    (["resctrl-join", "--root", "{root}", "--group", GROUP], oci_state(pid=1 << 40),
     "no valid pid"),
    (["resctrl-join", "--root", "{root}", "--group", GROUP], b'{"id": "x"}', "no valid pid"),
]


@pytest.mark.parametrize(("args", "stdin", "why"), BAD_CASES)
def test_errors_exit_zero_and_explain(tree: Path, args: list[str], stdin: bytes,
                                      why: str) -> None:
    argv = [a.replace("{root}", str(tree)) for a in args]
    out = io.StringIO()
    assert run(argv, io.BytesIO(stdin), out, SysFs("/")) == 0
    assert why in out.getvalue()
    assert (tree / GROUP / "mon_groups" / GROUP / "tasks").read_text() == ""
    # Strict: the same error fails the hook.
    strict = io.StringIO()
    assert run([*argv, "--strict"], io.BytesIO(stdin), strict, SysFs("/")) == 1
    assert why in strict.getvalue()


def test_oversized_state_is_refused(tree: Path) -> None:
    out = io.StringIO()
    big = b'{"pid": 1, "pad": "' + b"x" * (2 << 20) + b'"}'
    assert run(["resctrl-join", "--root", str(tree), "--group", GROUP],
               io.BytesIO(big), out, SysFs("/")) == 0
    assert "larger than" in out.getvalue()


def test_process_errors_and_strict_exit_code(tree: Path) -> None:
    args = ["resctrl-join", "--root", str(tree), "--group", "nriqos-missing"]
    lenient = hook(args, oci_state())
    assert lenient.returncode == 0
    assert b"nri-qos-hook:" in lenient.stderr
    assert b"No such file" in lenient.stderr
    strict = hook([*args, "--strict"], oci_state())
    assert strict.returncode == 1
    assert b"No such file" in strict.stderr
