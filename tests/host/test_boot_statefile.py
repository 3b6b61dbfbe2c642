"""The state file across a node's reboot: the kernel and kubelet rebuild every cgroup at boot, so
a note of a cgroup file's value from before the agent's write, taken in an earlier boot, is no
longer what to give back; a note of the API server's objects (a taint, a node condition) still
is."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from reconciler.eviction.conditions import EVICTION_CONDITION_NOTES
from reconciler.host import statefile
from reconciler.host.cgroups import layout_for
from reconciler.host.resctrlfs import PREFIX_NOTES
from reconciler.host.statefile import STATE_FILE, state_file
from reconciler.host.sysfs import SysFs
from reconciler.loops.container_values import NOTES as VALUE_NOTES
from reconciler.loops.cpu_idle import NOTES as IDLE_NOTES
from reconciler.loops.kubelet_notes import KUBELET_NOTES
from reconciler.loops.memory_guard import NOTES as GUARD_NOTES
from reconciler.loops.memory_guard import MemoryGuardLoop
from reconciler.loops.numa_binding import NUMA_BALANCE_NOTES, NUMA_NOTES
from reconciler.loops.protection import PROTECTION_NOTES, WRITTEN_NOTES
from reconciler.mitigation.actions import CONDITION_NOTES, TAINT_NOTES, WMARK_NOTES
from tests.support.fakesys import GIB, FakeHost
from tests.support.guard_config import standing

THIS_BOOT = "8d1c0f7e-5a3b-4c2d-9e6f-0a1b2c3d4e5f"
"""The boot the tests run in (the agent passes the kernel's, :func:`statefile.boot_id`)."""
KERNEL_SECTIONS = (GUARD_NOTES, IDLE_NOTES, NUMA_NOTES, NUMA_BALANCE_NOTES, PROTECTION_NOTES,
                   WRITTEN_NOTES, WMARK_NOTES, VALUE_NOTES, KUBELET_NOTES)
API_SECTIONS = (TAINT_NOTES, CONDITION_NOTES, EVICTION_CONDITION_NOTES)


def test_the_boot_is_the_kernels_under_the_root(tmp_path: Path) -> None:
    kernels = Path(statefile.BOOT_ID).read_text().strip()
    assert statefile.boot_id(SysFs("/")) == kernels
    assert statefile.boot_id(SysFs(tmp_path)) is None  # a root without the file: not known
    (tmp_path / statefile.BOOT_ID.lstrip("/")).parent.mkdir(parents=True)
    (tmp_path / statefile.BOOT_ID.lstrip("/")).write_text(f"{THIS_BOOT}\n")
    assert statefile.boot_id(SysFs(tmp_path)) == THIS_BOOT


def test_every_section_of_cgroup_files_and_containers_is_bound_to_the_boot() -> None:
    assert set(KERNEL_SECTIONS) == statefile.BOOT_BOUND
    assert not statefile.BOOT_BOUND & {*API_SECTIONS, PREFIX_NOTES}


def earlier_boot() -> str:
    other = str(uuid.uuid4())
    assert other != THIS_BOOT
    return other


def reboot(state_dir: Path) -> None:
    """What a reboot leaves of the state file: the same notes, written in another boot."""
    path = state_dir / STATE_FILE
    doc = json.loads(path.read_text())
    doc["boot_id"] = earlier_boot()
    path.write_text(json.dumps(doc))


def guard(host: FakeHost, state_dir: Path, cfg: list[Config]) -> MemoryGuardLoop:
    audit = AuditLog(MemoryAuditSink())
    sysfs = SysFs(host.root, audit)
    return MemoryGuardLoop(lambda: cfg[0], sysfs, layout_for(sysfs), audit,
                           notes=state_file(str(state_dir), boot=THIS_BOOT))


def test_a_tier_value_noted_in_an_earlier_boot_is_not_written_back_after_a_reboot(
        tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "host", version=1, driver="cgroupfs")
    host.set_numa([(8 * GIB, 32 * GIB, 0)])
    host.set_tier_usage("besteffort", 2 * GIB, per_node=[2 * GIB])
    limit = host.tier_dir("besteffort") / "memory.limit_in_bytes"
    limit.write_text(str(20 * GIB))
    state_dir = tmp_path / "state"
    cfg = [standing()]
    guard(host, state_dir, cfg).cycle(0.0)  # the earlier boot's agent caps the tier
    assert limit.read_text().strip() != str(20 * GIB)
    reboot(state_dir)
    limit.write_text(str(24 * GIB))  # kubelet's value in the new boot
    again = guard(host, state_dir, cfg)
    again.cycle(0.0)
    assert limit.read_text().strip() != str(24 * GIB)
    cfg[0] = dataclasses.replace(cfg[0], memory_guard=dataclasses.replace(
        cfg[0].memory_guard, enabled=False))
    again.cycle(1.0)
    assert limit.read_text().strip() == str(24 * GIB)
    assert state_file(str(state_dir), boot=THIS_BOOT).entries(GUARD_NOTES) == {}


def test_after_a_reboot_the_notes_of_cgroups_go_and_the_notes_of_the_api_stay(
        tmp_path: Path) -> None:
    doc: dict[str, object] = {name: {f"/sys/fs/cgroup/{name}": "1"} for name in KERNEL_SECTIONS}
    doc.update({name: {f"key-{name}": "NoSchedule"} for name in API_SECTIONS})
    doc[PREFIX_NOTES] = {"nri-qos-": "/sys/fs/resctrl"}
    doc["boot_id"] = earlier_boot()
    (tmp_path / STATE_FILE).write_text(json.dumps(doc))
    notes = state_file(str(tmp_path), boot=THIS_BOOT)
    for name in KERNEL_SECTIONS:
        assert notes.entries(name) == {}, name
    for name in API_SECTIONS:
        assert notes.entries(name) == {f"key-{name}": "NoSchedule"}, name
    assert notes.entries(PREFIX_NOTES) == {"nri-qos-": "/sys/fs/resctrl"}
    notes.put(TAINT_NOTES, "another", "NoSchedule")
    saved = json.loads((tmp_path / STATE_FILE).read_text())
    assert saved["boot_id"] == THIS_BOOT
    assert not set(KERNEL_SECTIONS) & set(saved)
    assert saved[CONDITION_NOTES] == {f"key-{CONDITION_NOTES}": "NoSchedule"}


def test_a_file_of_this_boot_keeps_every_note(tmp_path: Path) -> None:
    notes = state_file(str(tmp_path), boot=THIS_BOOT)
    notes.put(GUARD_NOTES, "/sys/fs/cgroup/memory/kubepods/besteffort/memory.limit_in_bytes",
              "max")
    assert json.loads((tmp_path / STATE_FILE).read_text())["boot_id"] == THIS_BOOT
    assert state_file(str(tmp_path), boot=THIS_BOOT).entries(GUARD_NOTES) != {}


def test_a_file_that_names_no_boot_keeps_every_note(tmp_path: Path) -> None:
    """Written by a version that did not name the boot: which boot it is of is not known, and a
    note dropped would leave its effect for good if it is of this one."""
    doc = {GUARD_NOTES: {"/sys/fs/cgroup/x/memory.limit_in_bytes": "max"},
           TAINT_NOTES: {"k": "NoSchedule"}}
    (tmp_path / STATE_FILE).write_text(json.dumps(doc))
    notes = state_file(str(tmp_path), boot=THIS_BOOT)
    assert notes.entries(GUARD_NOTES) == doc[GUARD_NOTES]
    assert notes.entries(TAINT_NOTES) == doc[TAINT_NOTES]
