"""What a guest boots: Debian's kernel, unpacked (never installed), and a busybox initramfs.

Everything is kept in one cache directory (``NRI_QOS_VM_CACHE``, default
``/var/cache/nri-qos-vm``): the kernel package is downloaded once, the initramfs is rebuilt only
when the guest's init script changes. A lock file keeps two builds from racing.
"""

from __future__ import annotations

import dataclasses
import fcntl
import gzip
import hashlib
import lzma
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

INIT = Path(__file__).with_name("init")
PACKAGES = ("qemu-system-x86", "busybox-static", "cpio", "e2fsprogs")
# Loaded in this order by the init: 9p over virtio for the host's root, overlay on top of it,
# ext4 on a virtio disk for the scratch disk. Everything else the guest needs is built in.
MODULES = (
    "drivers/virtio/virtio_ring", "drivers/virtio/virtio", "drivers/virtio/virtio_pci_modern_dev",
    "drivers/virtio/virtio_pci_legacy_dev", "drivers/virtio/virtio_pci", "fs/netfs/netfs",
    "fs/fscache/fscache", "net/9p/9pnet", "net/9p/9pnet_virtio", "fs/9p/9p",
    "fs/overlayfs/overlay", "lib/crc16", "crypto/crc32c_generic", "lib/libcrc32c",
    "fs/mbcache", "fs/jbd2/jbd2", "fs/ext4/ext4", "drivers/block/virtio_blk",
)


class Unavailable(RuntimeError):
    """A guest cannot be run on this machine; the message says why."""


@dataclasses.dataclass(frozen=True)
class Image:
    kernel: Path
    initramfs: Path
    release: str


def cache_dir() -> Path:
    return Path(os.environ.get("NRI_QOS_VM_CACHE", "/var/cache/nri-qos-vm"))


def unavailable() -> str:
    """Why no guest can run here without installing anything ("" when one can)."""
    if os.geteuid() != 0:
        return "needs root (the host's root is shared with the guest, and packages are installed)"
    if shutil.which("apt-get") is None and shutil.which("qemu-system-x86_64") is None:
        return "needs qemu-system-x86_64, or apt-get to install it"
    return ""


def ensure(log: bool = True) -> Image:
    """The packages installed, the kernel unpacked and the initramfs built; raises Unavailable."""
    reason = unavailable()
    if reason:
        raise Unavailable(reason)
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / "lock"):
        _install_packages(log)
        release, kernel, modules = _kernel(cache, log)
        initramfs = _initramfs(cache, release, modules)
    return Image(kernel, initramfs, release)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _say(log: bool, text: str) -> None:
    if log:
        print(f"nriqos-vm: {text}", flush=True)


def _install_packages(log: bool) -> None:
    missing = [p for p in PACKAGES if subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True,
    ).stdout.split()[-1:] != ["installed"]]
    if not missing:
        return
    _say(log, f"installing {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _apt(["apt-get", "update", "-q"], env)
    _apt(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env)


def _apt(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    if done.returncode != 0:
        raise Unavailable(f"{' '.join(argv)} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def _kernel_package() -> str:
    """Debian's current kernel for this release; the package lists are fetched if apt has none."""
    for attempt in range(2):
        if attempt:
            _apt(["apt-get", "update", "-q"])
        depends = subprocess.run(["apt-cache", "depends", "linux-image-amd64"],
                                 capture_output=True, text=True).stdout
        for line in depends.splitlines():
            key, _, name = line.strip().partition(": ")
            if key == "Depends" and name.startswith("linux-image-"):
                return name
    raise Unavailable("no linux-image-*-amd64 package is known to apt")


def _kernel(cache: Path, log: bool) -> tuple[str, Path, Path]:
    """The cached kernel (vmlinuz, modules directory), downloading it the first time."""
    unpacked = cache / "kernel"
    found = sorted(unpacked.glob("boot/vmlinuz-*"))
    if not found:
        package = _kernel_package()
        _say(log, f"downloading {package} (once)")
        download = cache / "download"
        shutil.rmtree(download, ignore_errors=True)
        download.mkdir()
        try:
            _apt(["apt-get", "download", "-q", package], cwd=download)
        except Unavailable:
            # Package lists older than the mirror name a version it no longer has.
            _apt(["apt-get", "update", "-q"])
            package = _kernel_package()
            _apt(["apt-get", "download", "-q", package], cwd=download)
        [deb] = download.glob("*.deb")
        shutil.rmtree(unpacked, ignore_errors=True)
        _apt(["dpkg-deb", "-x", str(deb), str(unpacked)])
        shutil.rmtree(download)
        found = sorted(unpacked.glob("boot/vmlinuz-*"))
        if not found:
            raise Unavailable(f"{package} holds no kernel image")
    kernel = found[-1]
    release = kernel.name.removeprefix("vmlinuz-")
    return release, kernel, unpacked / "lib/modules" / release


def _initramfs(cache: Path, release: str, modules: Path) -> Path:
    busybox = shutil.which("busybox")
    if busybox is None:
        raise Unavailable("busybox (busybox-static) is not installed")
    digest = hashlib.sha256(INIT.read_bytes() + "\n".join(MODULES).encode()).hexdigest()[:12]
    target = cache / f"initramfs-{release}-{digest}.gz"
    if target.is_file():
        return target
    build = cache / "initramfs.d"
    shutil.rmtree(build, ignore_errors=True)
    for sub in ("bin", "lib/modules", "proc", "sys", "dev"):
        (build / sub).mkdir(parents=True)
    shutil.copy2(busybox, build / "bin/busybox")
    names = []
    for module in MODULES:
        names.append(module.rsplit("/", 1)[1])
        (build / "lib/modules" / f"{names[-1]}.ko").write_bytes(_module(modules, module))
    (build / "modules").write_text("\n".join(names) + "\n")
    shutil.copy2(INIT, build / "init")
    (build / "init").chmod(0o755)
    listing = "\n".join(sorted(str(p.relative_to(build)) for p in build.rglob("*"))) + "\n"
    archive = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=build,
                             input=listing.encode(), capture_output=True, check=True).stdout
    for stale in cache.glob("initramfs-*.gz"):
        stale.unlink()
    partial = target.with_suffix(".part")
    partial.write_bytes(gzip.compress(archive, compresslevel=1))
    partial.rename(target)
    shutil.rmtree(build)
    return target


def _module(modules: Path, name: str) -> bytes:
    base = modules / "kernel" / name
    for suffix, unpack in ((".ko", bytes), (".ko.xz", lzma.decompress)):
        path = base.with_name(base.name + suffix)
        if path.is_file():
            return unpack(path.read_bytes())
    raise Unavailable(f"module {name} is missing from the kernel package")
