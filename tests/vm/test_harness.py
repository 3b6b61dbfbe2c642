"""The guest harness itself: its command line, the QEMU machine it describes, the tier's reading
of a guest's reports (no guest booted), and real guests run from the host with the tier."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.vm.image import Image
from tests.vm.machine import (
    NO_STATUS,
    Guest,
    Result,
    keep_files,
    qemu_argv,
    run,
    sweep,
)
from tests.vm.tier import GUEST_DEADLINE_S, GuestFailure, GuestRun, host_markers

REPO = Path(__file__).resolve().parents[2]
IMAGE = Image(Path("/k/vmlinuz"), Path("/k/initramfs.gz"), "6.1.0-test")
host_tier = pytest.mark.vm(host=True)


def qemu_running(workdir: str) -> bool:
    """Whether the QEMU of the run with this private directory is still there (other guests,
    of other runs, may be)."""
    assert workdir
    return subprocess.run(["pgrep", "-f", f"qemu-system-x86_64.*{workdir}"],
                          capture_output=True, check=False).returncode == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--", "true", "--numa", "0"], ""),  # options after -- belong to the command
    (["--numa", "0", "--", "true"], "numa must be 1 to 8 nodes"),
    (["--cgroup", "v3", "--", "true"], "invalid choice: 'v3'"),
    (["--mem-mib", "128", "--", "true"], "at least 256 MiB"),
    (["--disk"], "no command"),
])
def test_the_command_line_refuses_what_cannot_boot(argv: list[str], message: str) -> None:
    if not message:
        from tests.vm.__main__ import parse
        guest, command, _, save = parse(argv)
        assert command == ["true", "--numa", "0"]
        assert guest == Guest()
        assert save is None
        assert parse(["--save", "runs", "--", "true"])[3] == Path("runs")
        return
    done = subprocess.run([sys.executable, "-m", "tests.vm", *argv], cwd=REPO,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert message in done.stderr


def test_numa_nodes_get_their_memory_and_cpus() -> None:
    argv = qemu_argv(Guest(numa=2, mem_mib=3072, cpus=2, disk=True), IMAGE, Path("/x"),
                     Path("/x/disk.img"))
    joined = " ".join(argv)
    assert "-m 6144" in joined
    assert "memory-backend-ram,id=m0,size=3072M -numa node,nodeid=0,memdev=m0,cpus=0" in joined
    assert "memory-backend-ram,id=m1,size=3072M -numa node,nodeid=1,memdev=m1,cpus=1" in joined
    assert "file=/x/disk.img,if=virtio,format=raw,cache=none" in joined
    assert "nriqos.cgroup=v2" in joined
    # a third node has memory and no CPU (two CPUs to spread)
    three = " ".join(qemu_argv(Guest(numa=3), IMAGE, Path("/x"), None))
    assert three.endswith("nodeid=2,memdev=m2")
    assert "-drive" not in three


def test_saved_files_are_the_regular_files_byte_for_byte(tmp_path: Path) -> None:
    source, into = tmp_path / "artifacts", tmp_path / "saved"
    (source / "keep" / "coloc-agent-1").mkdir(parents=True)
    (source / "run.json").write_text("{}")
    raw = bytes(range(256)) * 3  # not text: copied as it is
    (source / "keep" / "coloc-agent-1" / "service.bin").write_bytes(raw)
    (source / "keep" / "empty").mkdir()
    (source / "keep" / "link").symlink_to("/etc/passwd")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(source / "keep" / "coloc-agent-1" / "nri.sock"))
        keep_files(source, into)
    assert (into / "run.json").read_text() == "{}"
    assert (into / "keep" / "coloc-agent-1" / "service.bin").read_bytes() == raw
    assert (into / "keep" / "empty").is_dir()
    assert sorted(p.name for p in (into / "keep" / "coloc-agent-1").iterdir()) == ["service.bin"]
    assert not (into / "keep" / "link").exists()


def result(lines: list[str], status: int = 0) -> Result:
    return Result(status, "out", "console", 1.0, {"results.jsonl": "\n".join(lines)})


def report(nodeid: str, when: str, outcome: str, longrepr: str = "") -> str:
    import json
    return json.dumps({"nodeid": nodeid, "when": when, "outcome": outcome,
                       "longrepr": longrepr, "duration": 0.1})


def test_a_run_removes_what_a_killed_harness_left(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a harness that no longer runs
    dead = tmp_path / f"nriqos-vm-{gone.pid}-k1"
    (dead / "exchange").mkdir(parents=True)
    (dead / "scratch.img").write_bytes(b"disk")
    alive = tmp_path / f"nriqos-vm-{os.getpid()}-k2"  # this process's own run
    alive.mkdir()
    unnamed = tmp_path / "nriqos-vm-1xi78zlw"  # no harness's pid in its name: not ours to judge
    unnamed.mkdir()
    # stands for the killed harness's QEMU, which names the directory on its command line
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                               str(dead / "scratch.img")])
    try:
        # Popen returns once the child has begun its exec, a moment before the kernel gives it
        # its new command line (read empty until then); a killed harness's QEMU has long had it.
        deadline = time.monotonic() + 10
        while str(dead).encode() not in Path(f"/proc/{orphan.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the stand-in never named the directory"
            time.sleep(0.01)
        assert sweep(tmp_path) == [dead]
        assert orphan.wait(timeout=10) == -9
    finally:
        orphan.kill()
        orphan.wait()
    assert not dead.exists()
    assert alive.is_dir()
    assert unnamed.is_dir()
    assert sweep(tmp_path) == []


def test_the_host_waits_for_a_guest_under_its_deadline_not_a_tests_timeout() -> None:
    """The first test of a guest boots it and waits for all its tests: a test's own
    timeout of 120 s cut a guest of eight tests short."""
    vm = pytest.mark.vm(numa=2).mark
    markers = host_markers([pytest.mark.timeout(120).mark, vm])
    assert [m for m in markers if m.name == "timeout"] == [
        pytest.mark.timeout(GUEST_DEADLINE_S + 120).mark]
    assert vm in markers


def test_a_guest_report_is_the_tests_verdict() -> None:
    run_ = GuestRun(result([report("a", "call", "passed"), report("b", "call", "failed", "E x"),
                            report("c", "setup", "skipped", "no PSI")]))
    run_.verdict("a")
    with pytest.raises(GuestFailure, match="E x"):
        run_.verdict("b")
    with pytest.raises(GuestFailure, match=r"skipped in the guest.*no PSI"):
        run_.verdict("c")
    with pytest.raises(GuestFailure, match="did not run in the guest"):
        run_.verdict("d")
    with pytest.raises(GuestFailure, match="the guest did not finish"):
        GuestRun(result([], NO_STATUS)).verdict("a")
    with pytest.raises(GuestFailure, match="no guest could be run: no qemu"):
        GuestRun(None, "no guest could be run: no qemu").verdict("a")


@host_tier
def test_a_v2_guest_runs_a_command_and_leaves_nothing_behind(tmp_path: Path) -> None:
    done = run(Guest(numa=2, mem_mib=512), ["sh", "-c", "cat /sys/fs/cgroup/cgroup.subtree_control;"
               " ls -d /sys/devices/system/node/node*; touch /usr/written-here;"
               " mkdir $NRIQOS_VM_ARTIFACTS/run; printf 'a\\000b' > $NRIQOS_VM_ARTIFACTS/run/x.bin;"
               " exit 7"], save=tmp_path / "saved")
    assert done.status == 7
    assert (tmp_path / "saved" / "run" / "x.bin").read_bytes() == b"a\0b"  # what it handed back
    lines = done.output.splitlines()
    assert lines[0].split() == ["cpuset", "cpu", "io", "memory", "pids"]
    assert lines[1:3] == ["/sys/devices/system/node/node0", "/sys/devices/system/node/node1"]
    assert not Path("/usr/written-here").exists()  # the guest's writes stay in the guest
    assert not Path(done.workdir).exists()  # its files, disk image included, are gone
    assert not qemu_running(done.workdir)


@host_tier
def test_a_v1_guest_with_a_scratch_disk() -> None:
    done = run(Guest(cgroup="v1", disk=True, mem_mib=512), [
        "sh", "-c", "ls /sys/fs/cgroup; stat -f -c %T /var/tmp; echo $TMPDIR; "
                    "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"/var/tmp/s\")'"
                    " && echo socket"])
    assert done.status == 0, done.output
    lines = done.output.split()
    assert {"memory", "cpu,cpuacct", "cpu", "cpuacct", "cpuset", "pids", "unified"} <= set(lines)
    assert "ext2/ext3" in lines
    assert lines[-2:] == ["/var/tmp", "socket"]


@host_tier
def test_a_guest_past_its_deadline_is_killed(tmp_path: Path) -> None:
    done = run(Guest(mem_mib=512), ["sh", "-c", "echo so-far > $NRIQOS_VM_ARTIFACTS/partial;"
                                    " sleep 600"], timeout_s=30, save=tmp_path)
    assert done.status == NO_STATUS
    assert (tmp_path / "partial").read_text() == "so-far\n"  # what it left is handed back
    assert done.seconds < 60
    assert not Path(done.workdir).exists()  # its files, disk image included, are gone
    assert not qemu_running(done.workdir)


@host_tier
def test_a_harness_ended_by_sigterm_kills_its_guest_and_removes_its_files() -> None:
    harness = subprocess.Popen([sys.executable, "-m", "tests.vm", "--mem-mib", "512", "--",
                                "sh", "-c", "echo up; sleep 600"], cwd=REPO,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert harness.stdout is not None
        while (line := harness.stdout.readline()) and line.strip() != "up":
            pass  # what the harness says before the guest runs the command
        assert line.strip() == "up"
        workdirs = list(Path(tempfile.gettempdir()).glob(f"nriqos-vm-{harness.pid}-*"))
        assert len(workdirs) == 1
        harness.terminate()
        assert harness.wait(timeout=30) == 128 + 15
    finally:
        harness.kill()
        harness.wait()
        if harness.stdout is not None:
            harness.stdout.close()
    assert not workdirs[0].exists()  # its files, disk image included, are gone
    assert not qemu_running(str(workdirs[0]))
