"""Fake resctrl trees for tests, modelled on real Intel and AMD hosts."""

from __future__ import annotations

from pathlib import Path


def _files(base: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def intel_tree(root: Path, *, num_closids: int = 16, mb_mode: str = "percent") -> Path:
    """Two L3 caches of 11 ways (cbm_mask 7ff), MB in percent with 10 % granularity."""
    mb_value = "4294967295" if mb_mode == "mbps" else "100"
    _files(root, {
        "info/L3/cbm_mask": "7ff\n",
        "info/L3/min_cbm_bits": "1\n",
        "info/L3/num_closids": f"{num_closids}\n",
        "info/L3/shareable_bits": "0\n",
        "info/MB/bandwidth_gran": "10\n",
        "info/MB/min_bandwidth": "10\n",
        "info/MB/num_closids": f"{num_closids}\n",
        "info/MB/delay_linear": "1\n",
        "info/L3_MON/num_rmids": "176\n",
        "info/L3_MON/mon_features": "llc_occupancy\nmbm_total_bytes\nmbm_local_bytes\n",
        # The kernel right-aligns resource names.
        "schemata": f"    L3:0=7ff;1=7ff\n    MB:0={mb_value};1={mb_value}\n",
        "tasks": "1\n2\n",
        "cpus": "ff\n",
    })
    (root / "mon_groups").mkdir()
    (root / "mon_data").mkdir()
    return root


def amd_tree(root: Path, *, num_closids: int = 16) -> Path:
    """Two CCX L3 caches of 16 ways (cbm_mask ffff), MB in absolute units (2048 = unthrottled)."""
    _files(root, {
        "info/L3/cbm_mask": "ffff\n",
        "info/L3/min_cbm_bits": "1\n",
        "info/L3/num_closids": f"{num_closids}\n",
        "info/MB/bandwidth_gran": "1\n",
        "info/MB/min_bandwidth": "0\n",
        "info/MB/num_closids": f"{num_closids}\n",
        "info/MB/delay_linear": "0\n",
        "schemata": "L3:0=ffff;1=ffff\nMB:0=2048;1=2048\n",
        "tasks": "1\n",
    })
    return root
