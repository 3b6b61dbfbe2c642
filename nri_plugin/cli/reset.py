"""``nri-qos reset``: take off this node everything the agent placed, as the uninstall step.

What the agent changed is read from its state file (``[reconciler] state_dir``) and from the
configuration, so an effect of an earlier run is found whatever the configuration says now:

* the memory guard's cap and squeeze on the BestEffort tier: the files' earlier values;
* ``memory.wmark_ratio`` the tune rung lowered on reclaimed pods: the earlier values;
* ``cpuset.mems`` the NUMA binding set on reclaimed containers: the earlier values;
* the containers' memcg values and processes' ``oom_score_adj`` drift noted setting or finding
  applied at creation: the value from before, or kubelet's (as drift gives them back when no
  policy asks for them any more);
* the mitigation taint (every key noted, and the configured one), its node condition, the
  in-tree eviction plugins' conditions and every condition the eviction manager noted writing
  True (an out-of-tree plugin's), taken off the node's status, when the Kubernetes API is
  reachable;
* resctrl control groups carrying the agent's prefix, or a prefix an earlier run noted making
  groups with (removing a group hands its tasks back to the default group);
* the status socket file.

Every step is idempotent: a second reset finds nothing to do. A step that fails (a write the
kernel refuses, a group it will not remove yet) says why and keeps its note in the state file,
the other steps still run, and the reset exits with status 1: run it again. With
``[kubernetes] enabled = false`` a taint or condition the state file notes is left, and said;
enabled without usable credentials, such a taint or condition fails the reset (and stays noted).
``--dry-run`` prints the steps and changes nothing. The agent must not be running (it would
place its effects again): a reset that finds it answering on its status socket stops with exit
status 1. Writes to the host are audited as the agent's are; each step prints one line.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TextIO

from common.audit import AuditLog
from nri_plugin.config.loader import ConfigError
from nri_plugin.config.schema import Config
from nri_plugin.config.store import load_config
from nri_plugin.obs.logs import LoggingSetup
from reconciler.eviction.builtin import IN_TREE_CONDITIONS
from reconciler.eviction.conditions import EVICTION_CONDITION_NOTES
from reconciler.host.cgroups import CgroupLayout
from reconciler.host.probe import probe_host, reaches_host
from reconciler.host.resctrlfs import PREFIX_NOTES, ResctrlFs, removal_problem
from reconciler.host.statefile import StateFile, boot_id, state_file
from reconciler.host.sysfs import SysFs
from reconciler.kube import KubeActions, NodeOutcome, build_api_client, node_name
from reconciler.loops.container_values import NOTES as VALUE_NOTES
from reconciler.loops.cpu_idle import NOTES as CPU_IDLE_NOTES
from reconciler.loops.cpu_idle import restore_idle
from reconciler.loops.kubelet_notes import KUBELET_NOTES, give_back_noted
from reconciler.loops.memory_guard import NOTES as GUARD_NOTES
from reconciler.loops.memory_guard import restore_tier
from reconciler.loops.numa_binding import NUMA_BALANCE_NOTES, NUMA_NOTES, restore_bindings
from reconciler.loops.protection import PROTECTION_NOTES, WRITTEN_NOTES, restore_protection
from reconciler.mitigation.actions import (
    CONDITION_NOTES,
    TAINT_NOTES,
    WMARK_NOTES,
    restore_wmark,
)

REASON = "nri-qos reset"
CONNECT_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class Step:
    """One thing to undo: what it is, and the function that undoes it (returns what it did)."""

    what: str
    undo: Callable[[], str]


def agent_answers(path: str) -> bool:
    """Whether something accepts connections on the agent's status socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_S)
    try:
        sock.connect(path)
    except OSError:
        return False
    finally:
        sock.close()
    return True


def _listed(notes: Mapping[str, str]) -> str:
    """Noted files and the values they go back to, in path order."""
    return ", ".join(f"{path} to {value}" for path, value in sorted(notes.items()))


def _noted(what: str, notes: StateFile, section: str, undo: Callable[[], int]) -> Step:
    """A step that writes back the files noted in ``section``: failed while any note is left
    (a write the kernel refused keeps its note, for the next reset or the agent's restart)."""
    def run() -> str:
        written = undo()
        left = notes.entries(section)
        if left:
            return (f"failed ({len(left)} file(s) not restored, kept in the state file: "
                    f"{', '.join(sorted(left))})")
        return f"restored {written} file(s)"

    return Step(what, run)


def _host_steps(cfg: Config, sysfs: SysFs, notes: StateFile, audit: AuditLog) -> list[Step]:
    steps = []
    guard = notes.entries(GUARD_NOTES)
    if guard:
        steps.append(_noted(f"memory guard: restore {_listed(guard)}", notes, GUARD_NOTES,
                            lambda: len(restore_tier(sysfs, notes, REASON))))
    idle = notes.entries(CPU_IDLE_NOTES)
    if idle:
        steps.append(_noted(f"cpu idle: restore {_listed(idle)}", notes, CPU_IDLE_NOTES,
                            lambda: restore_idle(sysfs, notes, REASON)))
    protection = notes.entries(PROTECTION_NOTES)
    # A last write noted without a value from before (a run cut short between writing the file
    # back and dropping this note) restores nothing, but is the agent's to take away all the same.
    unpaired = notes.entries(WRITTEN_NOTES).keys() - protection.keys()
    if protection or unpaired:
        what = (f"restore memory.min/memory.low of {len(protection)} pod or tier file(s)"
                if protection else
                f"forget the last write to {len(unpaired)} file(s) noted without a value "
                "from before")
        steps.append(_noted(f"memory QoS: {what}", notes, PROTECTION_NOTES,
                            lambda: restore_protection(sysfs, notes, REASON)))
    wmark = notes.entries(WMARK_NOTES)
    if wmark:
        steps.append(_noted(f"tune: restore memory.wmark_ratio of {len(wmark)} pod(s)", notes,
                            WMARK_NOTES, lambda: restore_wmark(sysfs, notes, REASON)))
    balanced = notes.entries(NUMA_BALANCE_NOTES)
    if balanced:
        steps.append(_noted(
            f"NUMA balance: restore cpuset.mems of {len(balanced)} container(s)", notes,
            NUMA_BALANCE_NOTES,
            lambda: restore_bindings(sysfs, notes, REASON, NUMA_BALANCE_NOTES)))
    numa = notes.entries(NUMA_NOTES)
    if numa:
        steps.append(_noted(f"NUMA binding: restore cpuset.mems of {len(numa)} container(s)",
                            notes, NUMA_NOTES, lambda: restore_bindings(sysfs, notes, REASON)))
    host = probe_host(sysfs, cgroup_version=cfg.memory.cgroup_version,
                      cgroup_driver=cfg.reconciler.cgroup_driver,
                      resctrl_mount=cfg.resctrl.root, amd_mb_max=cfg.resctrl.amd_mb_max)
    noted = notes.entries(VALUE_NOTES)
    if noted:
        steps.append(Step(f"drift: give back the values of {len(noted)} container(s)",
                          functools.partial(_give_back_values, sysfs, host.cgroup, notes)))
    elif notes.entries(KUBELET_NOTES):
        steps.append(Step("drift: forget kubelet's values of the containers",
                          lambda: _forget(notes, KUBELET_NOTES)))
    if host.resctrl is not None:
        fs = ResctrlFs(sysfs, cfg.resctrl.root, host.resctrl, prefix=cfg.resctrl.group_prefix,
                       audit=audit)
        def remove_group(group: str) -> str:
            return "removed" if fs.remove_group(group, REASON) else "already gone"

        steps += [Step(f"resctrl: remove group {group}", functools.partial(remove_group, group))
                  for group in [*fs.our_groups(), *fs.old_groups(notes)]]
        if notes.entries(PREFIX_NOTES):
            steps.append(Step("resctrl: forget the group prefixes noted",
                              functools.partial(_forget_prefixes, fs, notes)))
    status = cfg.status.socket
    try:
        is_socket = stat.S_ISSOCK(os.lstat(status).st_mode)
    except OSError:
        is_socket = False
    if is_socket:
        steps.append(Step(f"status: remove socket {status}", lambda: _unlink(status)))
    return steps


def _give_back_values(sysfs: SysFs, layout: CgroupLayout, notes: StateFile) -> str:
    """Failed while a container's note is left (a write refused)."""
    given, left = give_back_noted(sysfs, layout, notes, REASON)
    if left:
        return (f"failed ({len(left)} container(s) not given back, kept in the state file: "
                f"{', '.join(left)})")
    return f"gave back the values of {given} container(s)"


def _forget(notes: StateFile, section: str) -> str:
    notes.replace(section, {})
    return "forgotten"


def _forget_prefixes(fs: ResctrlFs, notes: StateFile) -> str:
    """Forgets every group prefix noted of which no group is left; failed while one is."""
    fs.forget_prefixes(notes, own=True)
    left = sorted(prefix for prefix, mount in notes.entries(PREFIX_NOTES).items()
                  if mount == fs.mount)
    if left:
        return f"failed (groups of {', '.join(left)} left, kept in the state file)"
    return "done"


def _unlink(path: str) -> str:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return "already gone"
    return "removed"


def _node_steps(cfg: Config, notes: StateFile, audit: AuditLog) -> tuple[list[Step], str]:
    """The taint and condition steps, and a note when the API is out of reach."""
    api = build_api_client(cfg.kubernetes)
    if api is None:
        placed = _placed(notes)
        if not placed:
            return [], ("no Kubernetes API access: the node's taint and condition are left as "
                        "they are")
        # The configuration asks for the API: what an earlier run placed and stays is a
        # failure of the reset, not a note beside "nothing to undo".
        return [Step(f"node: remove {', '.join(placed)} placed by an earlier run",
                     lambda: "failed (no Kubernetes API access: no usable credentials; kept in "
                             "the state file)")], ""
    kube = KubeActions(api, cfg.kubernetes, audit)
    node = node_name(cfg.kubernetes)
    rung = cfg.mitigation.taint
    keys = list(dict.fromkeys([*notes.entries(TAINT_NOTES), rung.key]))
    kinds = list(dict.fromkeys([*notes.entries(CONDITION_NOTES), rung.condition,
                                *IN_TREE_CONDITIONS, *notes.entries(EVICTION_CONDITION_NOTES)]))

    def remove(key: str) -> str:
        outcome = asyncio.run(kube.remove_taint(node, key, reason=REASON))
        if outcome in (NodeOutcome.CHANGED, NodeOutcome.UNCHANGED):
            notes.forget(TAINT_NOTES, key)
        return {NodeOutcome.CHANGED: "removed", NodeOutcome.UNCHANGED: "not there"}.get(
            outcome, f"failed ({outcome.value})")

    def clear(kind: str) -> str:
        outcome = asyncio.run(kube.remove_node_condition(node, kind))
        if outcome in (NodeOutcome.CHANGED, NodeOutcome.UNCHANGED):
            notes.forget(CONDITION_NOTES, kind)
            notes.forget(EVICTION_CONDITION_NOTES, kind)
        return {NodeOutcome.CHANGED: "removed", NodeOutcome.UNCHANGED: "not there"}.get(
            outcome, f"failed ({outcome.value})")

    steps = [Step(f"node {node}: remove taint {key}", functools.partial(remove, key))
             for key in keys]
    steps += [Step(f"node {node}: remove condition {kind}", functools.partial(clear, kind))
              for kind in kinds]
    return steps, ""


def _placed(notes: StateFile) -> list[str]:
    """The taints and node conditions the state file notes an earlier run placing."""
    return [f"taint {key}" for key in notes.entries(TAINT_NOTES)] + [
        f"condition {kind}" for kind in dict.fromkeys([*notes.entries(CONDITION_NOTES),
                                                       *notes.entries(EVICTION_CONDITION_NOTES)])]


def _unreached(notes: StateFile) -> str:
    """What an earlier run placed on the node that a reset without the API leaves there ("" when
    nothing): said, since the state file keeps it for a reset with the API."""
    placed = _placed(notes)
    if not placed:
        return ""
    return (f"[kubernetes] enabled is false: {', '.join(placed)} placed by an earlier run "
            "stay on the node (kept in the state file; reset with Kubernetes access removes them)")


def reset(cfg: Config, audit: AuditLog, *, dry_run: bool, out: TextIO,
          kubernetes: bool = True) -> int:
    """Runs (or with ``dry_run`` prints) every step; 1 when one failed, else 0.
    ``kubernetes``: reach the API for the node's taint and condition."""
    sysfs = SysFs(cfg.reconciler.root, audit, retries=cfg.reconciler.write_retries)
    # A dry run changes nothing, the state file included (an invalid one stays where it is).
    notes = state_file(cfg.reconciler.state_dir, read_only=dry_run, boot=boot_id(sysfs))
    if notes.unreadable is not None:
        # Without its notes the reset would say "nothing to undo" of what they list, and a
        # step's own note written now would replace them.
        out.write(f"failed: cannot read the state file {notes.path} ({notes.unreadable}); "
                  "nothing is undone: run the reset again once it can be read\n")
        return 1
    if notes.set_aside is not None:
        fate = "a reset sets it aside" if dry_run else f"set aside as {notes.path}.bad"
        out.write(f"note: the state file {notes.path} is invalid ({notes.set_aside}), {fate}: "
                  "what it noted is not undone\n")
    if notes.of_earlier_boot:
        dropped = ", ".join(f"{count} of {section}" for section, count
                            in notes.of_earlier_boot.items())
        out.write(f"note: the state file {notes.path} was written before the node's last boot: "
                  f"its notes of cgroups and containers ({dropped}) are of what the boot "
                  "rebuilt, and are not written back\n")
    if notes.unknown:
        kept = ", ".join(f"{count} of {section}" for section, count in notes.unknown.items())
        out.write(f"note: the state file {notes.path} holds notes this version does not know "
                  f"({kept}), written by another version: they are kept and not undone; the "
                  "reset of the version that wrote them undoes them\n")
    if not reaches_host(sysfs):
        # Below it every noted file would look gone, and its note be dropped unrestored.
        out.write(f"failed: [reconciler] root = {cfg.reconciler.root} does not reach the host "
                  "(no sys/fs/cgroup or proc below it; in a pod, the host's /sys/fs and /proc "
                  "are mounted there); nothing is undone, the state file keeps its notes\n")
        return 1
    steps = _host_steps(cfg, sysfs, notes, audit)
    remark = ""
    if kubernetes and cfg.kubernetes.enabled:
        node_steps, remark = _node_steps(cfg, notes, audit)
        steps += node_steps
    elif kubernetes:
        remark = _unreached(notes)
    if remark:
        out.write(f"note: {remark}\n")
    if not steps:
        out.write("nothing to undo\n")
        return 0
    failed = False
    for step in steps:
        if dry_run:
            out.write(f"would {step.what}\n")
            continue
        try:
            result = step.undo()
        except OSError as exc:
            # A group the kernel will not remove yet (EBUSY), a socket on a read-only mount:
            # said, and the steps after it still run.
            result = f"failed ({removal_problem(exc)})"
        failed |= result.startswith("failed")
        out.write(f"{step.what}: {result}\n")
    if not dry_run and notes.unwritable is not None:
        # Its notes of what was just undone would have a later agent write their values from
        # before back over whatever the files hold by then.
        out.write(f"failed: the state file {notes.path} could not be written "
                  f"({notes.unwritable}): it still notes what was undone; run the reset again "
                  "once it can be written, or remove it\n")
        return 1
    return 1 if failed else 0


def main_reset(config_path: str | None, *, dry_run: bool, out: TextIO = sys.stdout,
               err: TextIO = sys.stderr) -> int:
    logging_setup = LoggingSetup(level="warning")
    try:
        try:
            cfg, _ = load_config(config_path)
        except ConfigError as exc:
            # Each line names the file it is about (the main file or a drop-in).
            for line in exc.lines():
                err.write(f"{line}\n")
            return 2
        logging_setup.apply(cfg.logging)
        if agent_answers(cfg.status.socket):
            err.write(f"nri-qos reset: an agent answers on {cfg.status.socket}; stop it first "
                      "(it would place what the reset takes away again)\n")
            return 1
        if not cfg.status.enabled:
            # The check above finds no agent of this configuration, running or not.
            out.write("note: [status] enabled is false: whether an agent still runs cannot be "
                      "told; stop it first (it would place what the reset takes away again)\n")
        return reset(cfg, logging_setup.audit, dry_run=dry_run, out=out)
    finally:
        logging_setup.close()
