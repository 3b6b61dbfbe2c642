"""One guest run: QEMU (TCG) boots the image, runs one command, powers off; nothing is left behind.

The host and the guest share two directories over 9p: the host's root (read-only, under a
tmpfs overlay in the guest) and a private exchange directory holding the command, its
environment, its output and its exit status. The output is copied to the caller while the
guest runs. A guest that does not finish within its deadline is killed, and so is the guest of
a harness ended by SIGTERM or SIGHUP (the command line). A harness killed outright leaves its
private directory (a scratch disk image among its files) and its QEMU; the next run removes
them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from tests.vm.image import Image, Unavailable, ensure

# The exit status when the guest did not run the command to its end (boot failure, deadline).
NO_STATUS = 125
# Where the init mounts the exchange directory in the guest.
GUEST_EXCHANGE = "/run/nriqos-vm"
# Variables the command inherits from the caller: where the host's Python and virtualenv are.
PASSED_ENV = ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "LANG", "LC_ALL", "TZ")
# A run's private directory (under the temporary directory): this, the harness's pid, a dash.
WORK_PREFIX = "nriqos-vm-"


@dataclasses.dataclass(frozen=True)
class Guest:
    """The machine: NUMA nodes with their memory, cgroup version, scratch disk, CPUs."""

    numa: int = 1
    mem_mib: int = 2048  # per NUMA node
    cgroup: str = "v2"
    disk: bool = False
    cpus: int = 2
    disk_gib: int = 8

    def __post_init__(self) -> None:
        if self.cgroup not in ("v1", "v2"):
            raise ValueError(f"cgroup must be v1 or v2, not {self.cgroup!r}")
        if not 1 <= self.numa <= 8:
            raise ValueError("numa must be 1 to 8 nodes")
        if self.mem_mib < 256:
            raise ValueError("each NUMA node needs at least 256 MiB")

    def describe(self) -> str:
        disk = ", scratch disk" if self.disk else ""
        return (f"cgroup {self.cgroup}, {self.numa} NUMA node(s) of {self.mem_mib} MiB, "
                f"{self.cpus} CPUs{disk}")


@dataclasses.dataclass(frozen=True)
class Result:
    status: int
    output: str
    console: str  # the kernel's and the init's messages: why a guest did not finish
    seconds: float
    # Files the command left in $NRIQOS_VM_ARTIFACTS, by name: what it hands back to the host.
    artifacts: dict[str, str] = dataclasses.field(default_factory=dict)
    # The run's private directory (removed): QEMU's command line names it.
    workdir: str = ""


# The emulated CPU. "max" offers ERMS and AVX2, which TCG emulates slowly: the kernel then clears
# and copies pages with "rep stosb"/"rep movsb" and OpenSSL hashes with AVX2. Measured in a guest
# of one node on a 2-core host: touching 512 MiB of new memory 4.9 s with "max", 1.7 s with
# "qemu64"; copying 512 MiB 4.9 s / 1.8 s; reading 256 MiB of page cache 4.2 s / 1.0 s; SHA-256
# of 20 MiB 1.2 s / 0.5 s; a Python loop alike (0.8 s per million steps).
CPU_MODEL = "qemu64"


def qemu_argv(guest: Guest, image: Image, exchange: Path, disk: Path | None) -> list[str]:
    argv = [
        "qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", CPU_MODEL,
        "-smp", str(guest.cpus), "-m", str(guest.mem_mib * guest.numa),
        "-display", "none", "-monitor", "none", "-no-reboot",
        "-serial", f"file:{exchange / 'console'}",
        "-kernel", str(image.kernel), "-initrd", str(image.initramfs),
        "-append", (f"console=ttyS0 panic=-1 psi=1 loglevel=4 nriqos.cgroup={guest.cgroup}"),
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                   "multidevs=remap",
        "-virtfs", f"local,path={exchange},mount_tag=exchange,security_model=none",
    ]
    for node in range(guest.numa):
        argv += ["-object", f"memory-backend-ram,id=m{node},size={guest.mem_mib}M"]
        spec = f"node,nodeid={node},memdev=m{node}"
        cpus = [c for c in range(guest.cpus) if c % guest.numa == node]
        if guest.numa > 1 and cpus:
            spec += "".join(f",cpus={c}" for c in cpus)
        argv += ["-numa", spec]
    if disk is not None:
        argv += ["-drive", f"file={disk},if=virtio,format=raw,cache=none"]
    return argv


def run(guest: Guest, command: list[str], *, cwd: Path | None = None,
        env: dict[str, str] | None = None, timeout_s: float = 1800.0,
        echo: TextIO | None = None, image: Image | None = None,
        save: Path | None = None) -> Result:
    """Runs ``command`` in a fresh guest; its output goes to ``echo`` as it comes. With
    ``save``, what the command left under ``$NRIQOS_VM_ARTIFACTS`` is copied there."""
    image = image or ensure()
    if not command:
        raise ValueError("no command to run")
    started = time.monotonic()
    sweep()
    with tempfile.TemporaryDirectory(prefix=f"{WORK_PREFIX}{os.getpid()}-") as tmp:
        exchange = Path(tmp) / "exchange"
        exchange.mkdir()
        (exchange / "command").write_text(shlex.join(command) + "\n")
        (exchange / "artifacts").mkdir()
        values = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        values.update(env or {})
        values.update(HOME="/root", NRIQOS_VM_CWD=str((cwd or Path.cwd()).resolve()),
                      NRIQOS_VM=f"{guest.cgroup}/numa{guest.numa}",
                      NRIQOS_VM_ARTIFACTS=f"{GUEST_EXCHANGE}/artifacts")
        if guest.disk:
            values["TMPDIR"] = "/var/tmp"
        (exchange / "env").write_text("".join(
            f"export {k}={shlex.quote(v)}\n" for k, v in sorted(values.items())))
        (exchange / "out").touch()
        disk = _scratch_disk(Path(tmp), guest.disk_gib) if guest.disk else None
        status = _boot(qemu_argv(guest, image, exchange, disk), exchange, timeout_s, echo)
        output = (exchange / "out").read_text(errors="replace")
        console = (exchange / "console").read_text(errors="replace") \
            if (exchange / "console").exists() else ""
        artifacts = {p.name: p.read_text(errors="replace")
                     for p in (exchange / "artifacts").iterdir() if p.is_file()}
        if save is not None:
            keep_files(exchange / "artifacts", save)
    return Result(status, output, console, time.monotonic() - started, artifacts, tmp)


def sweep(under: Path | None = None) -> list[Path]:
    """Remove the private directories (8 GiB scratch images among them) of runs whose harness
    is gone, killed outright where nothing could clean up, and stop their orphaned QEMU, whose
    output nobody reads any more. Returns what was removed."""
    removed = []
    for old in sorted((under or Path(tempfile.gettempdir())).glob(f"{WORK_PREFIX}*-*")):
        pid = old.name[len(WORK_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        for qemu in _processes_naming(old):
            with contextlib.suppress(ProcessLookupError):
                os.kill(qemu, signal.SIGKILL)
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old)
    return removed


def _processes_naming(directory: Path) -> list[int]:
    """The pids of the processes whose command line names ``directory`` (its QEMU)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(str(directory).encode() in arg for arg in argv):
                found.append(int(proc.name))
    return found


def keep_files(source: Path, into: Path) -> None:
    """The regular files and directories under ``source``, copied under ``into`` byte for byte
    (sockets and other special files a command leaves, e.g. a kept work directory's, are not
    files to hand back)."""
    for path in sorted(source.rglob("*")):
        target = into / path.relative_to(source)
        if path.is_dir() and not path.is_symlink():
            target.mkdir(parents=True, exist_ok=True)
        elif path.is_file() and not path.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def _scratch_disk(directory: Path, gib: int) -> Path:
    image = directory / "scratch.img"
    with image.open("wb") as f:
        f.truncate(gib << 30)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1",
                           str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        raise Unavailable(f"mkfs.ext4 failed: {made.stderr.strip()}")
    return image


def _boot(argv: list[str], exchange: Path, timeout_s: float, echo: TextIO | None) -> int:
    if shutil.which(argv[0]) is None:
        raise Unavailable(f"{argv[0]} is not installed")
    out = exchange / "out"
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    position = 0
    try:
        while True:
            finished = proc.poll() is not None
            position = _copy_new(out, position, echo)
            if finished:
                break
            if time.monotonic() > deadline:
                _stop(proc)
                if echo is not None:
                    echo.write(f"\nnriqos-vm: the guest did not finish within {timeout_s:.0f} s\n")
                return NO_STATUS
            time.sleep(0.2)
    except BaseException:
        _stop(proc)
        raise
    rc_file = exchange / "rc"
    if proc.returncode != 0 and not rc_file.exists():
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        raise Unavailable(f"qemu failed ({proc.returncode}): {err.strip()[-800:]}")
    if proc.stderr is not None:
        proc.stderr.close()
    text = rc_file.read_text().strip() if rc_file.exists() else ""
    return int(text) if text.isdigit() else NO_STATUS


def _copy_new(path: Path, position: int, echo: TextIO | None) -> int:
    with path.open("rb") as f:
        f.seek(position)
        data = f.read()
    if data and echo is not None:
        echo.write(data.decode(errors="replace"))
        echo.flush()
    return position + len(data)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


def _exit_on(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(guest: Guest, command: list[str], timeout_s: float, save: Path | None = None) -> int:
    """The command line's body: run, echo, explain a guest that did not finish. SIGTERM and
    SIGHUP end it as Ctrl-C does: the guest is killed and its directory removed."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on)
    try:
        result = run(guest, command, timeout_s=timeout_s, echo=sys.stdout, save=save)
    except Unavailable as exc:
        print(f"nriqos-vm: cannot run a guest here: {exc}", file=sys.stderr)
        return NO_STATUS
    if result.status == NO_STATUS:
        tail = "\n".join(result.console.splitlines()[-15:])
        print(f"nriqos-vm: the guest did not run the command to its end; its console:\n{tail}",
              file=sys.stderr)
    return result.status
