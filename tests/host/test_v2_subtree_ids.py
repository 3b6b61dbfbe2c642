"""The processes of a cgroup and of the cgroups below it (cgroup v2's no-internal-process rule
puts a container's processes in the cgroups it makes), on a fake tree."""

from __future__ import annotations

from pathlib import Path

from reconciler.host.cgroups import MOST_SUBTREE_CGROUPS, subtree_ids
from reconciler.host.sysfs import SysFs
from tests.support.fakesys import write

CONTAINER = "/sys/fs/cgroup/kubepods/besteffort/pod1/c1"


def test_the_ids_below_a_container_count_as_its_own(tmp_path: Path) -> None:
    root = tmp_path / CONTAINER.lstrip("/")
    write(root / "cgroup.procs", "")
    write(root / "init/cgroup.procs", "7\n8\n")
    write(root / "docker/abc/cgroup.procs", "9\n")
    write(root / "docker/cgroup.procs", "")
    assert sorted(subtree_ids(SysFs(tmp_path), CONTAINER)) == [7, 8, 9]


def test_a_container_that_makes_many_cgroups_costs_a_bounded_read(tmp_path: Path) -> None:
    root = tmp_path / CONTAINER.lstrip("/")
    write(root / "cgroup.procs", "1\n")
    for index in range(MOST_SUBTREE_CGROUPS + 50):
        write(root / f"g{index:04d}/cgroup.procs", f"{index + 100}\n")
    ids = subtree_ids(SysFs(tmp_path), CONTAINER)
    assert len(ids) == MOST_SUBTREE_CGROUPS
    assert ids[0] == 1


def test_a_cgroup_gone_has_no_ids(tmp_path: Path) -> None:
    assert subtree_ids(SysFs(tmp_path), CONTAINER) == []


def test_a_threaded_or_dot_named_cgroup_below_is_passed_over(tmp_path: Path) -> None:
    root = tmp_path / CONTAINER.lstrip("/")
    write(root / "cgroup.procs", "5\n")
    # A threaded cgroup's cgroup.procs: the kernel refuses to list it (EOPNOTSUPP), as a
    # directory in its place refuses the read (EISDIR).
    (root / "threads/cgroup.procs").mkdir(parents=True)
    write(root / "threads/inner/cgroup.procs", "6\n")
    write(root / ".hidden/cgroup.procs", "7\n")
    assert sorted(subtree_ids(SysFs(tmp_path), CONTAINER)) == [5, 6]
