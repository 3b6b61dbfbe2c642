"""A cgroup v2 container's ``memory.numa_stat`` as a fake mover of pages reads and rewrites it:
anonymous bytes per NUMA node (the file's first line), no page cache."""

from __future__ import annotations

from pathlib import Path


def read_stat(path: Path) -> dict[int, int]:
    first = path.read_text().splitlines()[0].split()[1:]
    return {int(f[1:].split("=")[0]): int(f.split("=")[1]) for f in first}


def write_stat(path: Path, per_node: dict[int, int]) -> None:
    nodes = " ".join(f"N{n}={v}" for n, v in sorted(per_node.items()))
    zero = " ".join(f"N{n}=0" for n in sorted(per_node))
    path.write_text(f"anon {nodes}\nfile {zero}\n")
