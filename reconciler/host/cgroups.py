"""Where a container's and a QoS tier's cgroups are, for both cgroup versions and both drivers.

NRI hands over the OCI ``cgroupsPath`` of each container, in one of two forms:

* cgroupfs driver: ``/kubepods/burstable/pod<uid>/<id>`` (guaranteed pods sit directly below
  ``/kubepods``);
* systemd driver: ``kubepods-burstable-pod<uid_with_underscores>.slice:cri-containerd:<id>``, that
  is ``<parent slice>:<prefix>:<name>``. A slice name ``a-b-c.slice`` nests as
  ``a.slice/a-b.slice/a-b-c.slice``, and the container is the scope ``<prefix>-<name>.scope`` in it.

Both resolve to a path relative to a hierarchy root: on cgroup v2 the one root
``/sys/fs/cgroup``, on v1 one root per controller (``/sys/fs/cgroup/memory``,
``/sys/fs/cgroup/cpuset`` ...). Pod data ends up in file names, so every component is checked:
no ``..``, no empty or dot components, only the characters cgroup names use.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

from hooks.untrusted import bounded_repr
from reconciler.host.sysfs import SysFs

CGROUP_MOUNT = "/sys/fs/cgroup"

GUARANTEED = "guaranteed"
BURSTABLE = "burstable"
BESTEFFORT = "besteffort"
TIERS = (GUARANTEED, BURSTABLE, BESTEFFORT)

CGROUPFS = "cgroupfs"
SYSTEMD = "systemd"

_COMPONENT = re.compile(r"[A-Za-z0-9_@:.+-]{1,255}")
_POD_DIR = re.compile(r"pod([A-Za-z0-9_-]+)")
_POD_SLICE = re.compile(r"kubepods(?:-(besteffort|burstable))?-pod([A-Za-z0-9_]+)\.slice")


class CgroupPathError(ValueError):
    """A cgroups path that is malformed or would leave the cgroup hierarchy."""


@dataclass(frozen=True, slots=True)
class CgroupRef:
    """A container's cgroup, independent of version and controller."""

    # Relative to a hierarchy root, e.g. "kubepods/burstable/pod<uid>/<id>".
    rel: str
    driver: str
    # guaranteed/burstable/besteffort, or None for a cgroup outside kubelet's layout.
    tier: str | None
    # The pod uid as written in the path (systemd: with underscores turned back into dashes).
    pod_uid: str | None


def _checked(parts: list[str], original: str) -> str:
    if not parts:
        raise CgroupPathError(f"empty cgroups path {bounded_repr(original)}")
    for part in parts:
        # A leading dot is refused too, as the sysfs layer refuses such paths.
        if part.startswith(".") or not _COMPONENT.fullmatch(part):
            raise CgroupPathError(f"cgroups path {bounded_repr(original)}: bad component "
                                  f"{bounded_repr(part)}")
    return "/".join(parts)


def expand_slice(slice_name: str) -> list[str]:
    """``a-b-c.slice`` -> ``["a.slice", "a-b.slice", "a-b-c.slice"]`` (systemd's nesting)."""
    if not slice_name.endswith(".slice") or slice_name == ".slice":
        raise CgroupPathError(f"not a slice name: {bounded_repr(slice_name)}")
    if slice_name == "-.slice":
        return []
    stem = slice_name[: -len(".slice")]
    if stem.startswith("-") or stem.endswith("-") or "--" in stem:
        raise CgroupPathError(f"malformed slice name: {bounded_repr(slice_name)}")
    words = stem.split("-")
    return ["-".join(words[: i + 1]) + ".slice" for i in range(len(words))]


def parse_cgroups_path(path: str) -> CgroupRef:
    """Parse NRI's ``cgroups_path`` (either driver); raises :class:`CgroupPathError`."""
    text = path.strip()
    if not text or "\0" in text:
        raise CgroupPathError(f"empty cgroups path {bounded_repr(path)}")
    if text.startswith("/"):
        parts = text.split("/")[1:]
        rel = _checked(parts, path)
        tier, uid = _cgroupfs_pod(parts)
        return CgroupRef(rel, CGROUPFS, tier, uid)
    fields = text.split(":")
    if len(fields) != 3:
        raise CgroupPathError(
            f"cgroups path {bounded_repr(path)}: expected /a/b/c or <slice>:<prefix>:<name>")
    parent, prefix, name = fields
    if "/" in parent or "/" in prefix or "/" in name or not name:
        raise CgroupPathError(f"cgroups path {bounded_repr(path)}: '/' inside a systemd path")
    parts = expand_slice(parent or "-.slice")
    unit = f"{prefix}-{name}" if prefix else name
    parts.append(unit if unit.endswith((".scope", ".slice")) else unit + ".scope")
    rel = _checked(parts, path)
    tier, uid = _systemd_pod(parts)
    return CgroupRef(rel, SYSTEMD, tier, uid)


def _cgroupfs_pod(parts: list[str]) -> tuple[str | None, str | None]:
    if "kubepods" not in parts:
        return None, None
    rest = parts[parts.index("kubepods") + 1:]
    if len(rest) >= 2 and rest[0] in (BURSTABLE, BESTEFFORT):
        m = _POD_DIR.fullmatch(rest[1])
        return (rest[0], m.group(1)) if m else (None, None)
    m = _POD_DIR.fullmatch(rest[0]) if rest else None
    return (GUARANTEED, m.group(1)) if m else (None, None)


def _systemd_pod(parts: list[str]) -> tuple[str | None, str | None]:
    for part in parts:
        m = _POD_SLICE.fullmatch(part)
        if m:
            return m.group(1) or GUARANTEED, m.group(2).replace("_", "-")
    return None, None


def pod_rel(ref: CgroupRef) -> str:
    """The pod's cgroup: the container's parent directory."""
    return ref.rel.rsplit("/", 1)[0]


def pod_parent_rel(cgroup_parent: str) -> str:
    """The pod's cgroup, relative to a hierarchy root, from the sandbox's CRI cgroup parent:
    ``/kubepods/besteffort/pod<uid>`` (cgroupfs) or ``kubepods-besteffort-pod<uid>.slice``
    (systemd, nested as systemd nests slices). Raises :class:`CgroupPathError`."""
    text = cgroup_parent.strip()
    if not text or "\0" in text:
        raise CgroupPathError(f"empty cgroup parent {cgroup_parent!r}")
    if text.startswith("/"):
        return _checked(text.split("/")[1:], cgroup_parent)
    if "/" in text or ":" in text:
        raise CgroupPathError(f"cgroup parent {cgroup_parent!r}: neither a path nor a slice")
    return _checked(expand_slice(text), cgroup_parent)


MOST_SUBTREE_CGROUPS = 256
"""Cgroups read at most by :func:`subtree_ids`: the ones below a container are its own to make,
as many as it likes."""


def subtree_ids(sysfs: SysFs, cgroup: str, name: str = "cgroup.procs") -> list[int]:
    """The ids in the file ``name`` of ``cgroup`` and of the cgroups below it (at most
    :data:`MOST_SUBTREE_CGROUPS` of them, nearest first). On cgroup v2 a cgroup that hands its
    controllers down to children keeps no process of its own (the "no internal process" rule):
    a container that makes cgroups of its own (Docker in Docker, a systemd inside) has all its
    processes in them and none in its own ``cgroup.procs``. A cgroup whose ``cgroup.procs``
    the kernel will not list (a threaded one: EOPNOTSUPP; its processes are listed by the
    threaded domain above it) counts none, and names no plain path can hold (a leading dot) are
    passed over: both are the container's to choose."""
    ids: list[int] = []
    queue = [cgroup]
    for index in range(MOST_SUBTREE_CGROUPS):
        if index >= len(queue):
            break
        here = queue[index]
        with contextlib.suppress(OSError, ValueError):
            ids.extend(sysfs.read_ids(f"{here}/{name}") or ())
        room = MOST_SUBTREE_CGROUPS - len(queue)
        children = [child for child in sysfs.list_subdirs(here) if not child.startswith(".")]
        queue.extend(f"{here}/{child}" for child in children[:room])
    return ids


def tier_rel(driver: str, tier: str) -> str:
    """kubelet's QoS-tier cgroup for a driver, relative to a hierarchy root."""
    if tier not in TIERS:
        raise ValueError(f"unknown QoS tier {tier!r}")
    if driver == SYSTEMD:
        return "kubepods.slice" if tier == GUARANTEED else f"kubepods.slice/kubepods-{tier}.slice"
    if driver == CGROUPFS:
        return "kubepods" if tier == GUARANTEED else f"kubepods/{tier}"
    raise ValueError(f"unknown cgroup driver {driver!r}")


def detect_version(sysfs: SysFs, override: str = "auto") -> int:
    """2 when the unified hierarchy is mounted at /sys/fs/cgroup (or forced), else 1."""
    if override in ("v1", "v2"):
        return int(override[1])
    if override != "auto":
        raise ValueError(f"cgroup version must be auto, v1 or v2, got {override!r}")
    return 2 if sysfs.exists(f"{CGROUP_MOUNT}/cgroup.controllers") else 1


def kubelet_driver(sysfs: SysFs, version: int) -> str | None:
    """The driver of the pods cgroup kubelet has made (``kubepods.slice``: systemd,
    ``kubepods``: cgroupfs); None before kubelet has made one."""
    base = CGROUP_MOUNT if version == 2 else f"{CGROUP_MOUNT}/memory"
    if sysfs.is_dir(f"{base}/{tier_rel(SYSTEMD, GUARANTEED)}"):
        return SYSTEMD
    if sysfs.is_dir(f"{base}/{tier_rel(CGROUPFS, GUARANTEED)}"):
        return CGROUPFS
    return None


def detect_driver(sysfs: SysFs, version: int, override: str = "auto") -> str:
    """The driver from the config, else from which kubepods directory exists (cgroupfs default)."""
    if override in (CGROUPFS, SYSTEMD):
        return override
    if override != "auto":
        raise ValueError(f"cgroup driver must be auto, cgroupfs or systemd, got {override!r}")
    return kubelet_driver(sysfs, version) or CGROUPFS


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """System paths of cgroup directories and files for one version and driver."""

    version: int
    driver: str
    mount: str = CGROUP_MOUNT
    # The driver was to be detected (``auto``) and kubelet had made neither ``kubepods.slice``
    # nor ``kubepods`` yet: ``driver`` is a guess, no path of this layout is to be acted on.
    awaiting_kubelet: bool = False

    @property
    def v2(self) -> bool:
        return self.version == 2

    def dir(self, controller: str, rel: str) -> str:
        """``rel`` in ``controller``'s hierarchy (v2 has one hierarchy for all)."""
        base = self.mount if self.v2 else f"{self.mount}/{controller}"
        return f"{base}/{rel}" if rel else base

    def tier_dir(self, controller: str, tier: str) -> str:
        return self.dir(controller, tier_rel(self.driver, tier))

    @property
    def limit_file(self) -> str:
        """A cgroup's memory limit: ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1)."""
        return "memory.max" if self.v2 else "memory.limit_in_bytes"

    @property
    def unlimited(self) -> str:
        """What a memory limit file takes for no limit: v1's refuses ``max`` (EINVAL)."""
        return "max" if self.v2 else "-1"

    @property
    def threads_file(self) -> str:
        """The file listing every thread of a cgroup."""
        return "cgroup.threads" if self.v2 else "tasks"

    @property
    def task_controller(self) -> str:
        """The v1 hierarchy read for task lists; every kubelet pod has a cpu cgroup."""
        return "cpu"


def layout_for(sysfs: SysFs, version_override: str = "auto",
               driver_override: str = "auto") -> CgroupLayout:
    version = detect_version(sysfs, version_override)
    awaiting = driver_override == "auto" and kubelet_driver(sysfs, version) is None
    return CgroupLayout(version, detect_driver(sysfs, version, driver_override),
                        awaiting_kubelet=awaiting)
