"""``nri-qos probe`` (and the agent's start) with a ``[reconciler] root`` that does not reach
the host: said first, not shown as a host with no cgroups, no memory and an unknown kernel."""

from __future__ import annotations

import io
from pathlib import Path

from nri_plugin.cli.probe import main_probe


def test_a_root_without_the_hosts_files_is_named_in_a_warning(tmp_path: Path) -> None:
    root = tmp_path / "not-the-host"
    root.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(f'[reconciler]\nroot = "{root}"\n[resctrl]\nenabled = false\n')
    out = io.StringIO()
    assert main_probe(str(config), as_json=False, out=out) == 0
    warnings = [line for line in out.getvalue().splitlines() if line.startswith("warning: ")]
    assert warnings[0] == (
        f"warning: [reconciler] root {root} does not reach the host: no sys/fs/cgroup or proc "
        "below it (in a pod, the host's /sys/fs and /proc are mounted there); what follows is "
        "not this host's")
