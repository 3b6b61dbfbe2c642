"""Two loops write a reclaimed container's ``cpuset.mems``: the binding and the balance.

The first to change the file notes its value from before and owns the undo; the other writes
without a note of its own. The owner giving its notes back (switched off, on its own thread)
while the other is writing must not leave that write with no note anywhere.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.host.cgroups import layout_for
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import Outcome, SysFs
from reconciler.loops.numa_balance import NumaBalanceLoop
from reconciler.loops.numa_binding import NUMA_BALANCE_NOTES, NUMA_NOTES, NumaBindingLoop
from tests.support.fakesys import GIB, FakeHost

UID = "11111111-0000-0000-0000-000000000001"


class OtherRunsDuringWrite(SysFs):
    """A loop's tree: its first ``cpuset.mems`` write lets the other loop's cycle run on its
    own thread first (as the scheduler may), waiting a moment for it."""

    def __init__(self, root: Path, audit: AuditLog) -> None:
        super().__init__(root, audit)
        self.other_cycle: Callable[[float], None] | None = None
        self.other: threading.Thread | None = None

    def write(self, path: str, value: str, reason: str, *, create: bool = False) -> Outcome:
        if path.endswith("/cpuset.mems") and self.other is None and self.other_cycle:
            self.other = threading.Thread(target=self.other_cycle, args=(0.0,))
            self.other.start()
            self.other.join(timeout=0.5)
        return super().write(path, value, reason, create=create)

    def other_ended(self) -> None:
        assert self.other is not None
        self.other.join(timeout=5.0)


@dataclass
class Node:
    cpuset: Path
    """The container's cpuset directory."""
    inside: str
    """The same, as the loops name it."""
    state: NodeState
    notes: StateFile
    plain: SysFs
    racing: OtherRunsDuringWrite
    audit: AuditLog


def reclaimed_pod(tmp_path: Path, section: str, before: str) -> Node:
    """A reclaimed pod on two nodes whose container's ``cpuset.mems`` is "0", ``before`` being
    its value before the agent, noted in ``section`` (the loop that changed it first)."""
    host = FakeHost(tmp_path, version=2, driver="cgroupfs")
    pod = host.add_pod(UID, tier="besteffort",
                       annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
    cpuset = host.cg("cpuset", pod.containers[0].rel)
    (cpuset / "cpuset.mems").write_text("0\n")
    host.set_numa([(20 * GIB, 64 * GIB, 1000), (30 * GIB, 64 * GIB, 1000)])
    state = NodeState()
    state.replace_all(*host.nri())
    notes = StateFile(None)
    audit = AuditLog(MemoryAuditSink())
    plain = SysFs(tmp_path, audit)
    inside = layout_for(plain).dir("cpuset", pod.containers[0].rel)
    notes.remember(section, f"{inside}/cpuset.mems", before)
    return Node(cpuset, inside, state, notes, plain, OtherRunsDuringWrite(tmp_path, audit),
                audit)


def test_a_binding_given_back_while_the_balance_writes_leaves_a_note_to_undo_the_write(
        tmp_path: Path) -> None:
    node = reclaimed_pod(tmp_path, NUMA_NOTES, "0-1")
    on = Config()
    off = dataclasses.replace(on, numa=dataclasses.replace(on.numa, enabled=False),
                              numa_balance=dataclasses.replace(on.numa_balance, enabled=False))
    binding = NumaBindingLoop(lambda: off, node.state, node.plain, layout_for(node.plain),
                              node.audit, notes=node.notes)
    node.racing.other_cycle = binding.cycle
    config = on
    balance = NumaBalanceLoop(lambda: config, node.state, node.racing,
                              layout_for(node.racing), node.audit, notes=node.notes)

    assert balance._set_mems(node.inside, frozenset({1}), "NUMA balance: memory moved")
    node.racing.other_ended()
    config = off
    balance.cycle(0.0)
    binding.cycle(0.0)

    assert (node.cpuset / "cpuset.mems").read_text().strip() == "0-1"


def test_a_balance_given_back_while_the_binding_writes_leaves_a_note_to_undo_the_write(
        tmp_path: Path) -> None:
    node = reclaimed_pod(tmp_path, NUMA_BALANCE_NOTES, "0")
    on = Config()
    binding_only = dataclasses.replace(
        on, numa=dataclasses.replace(on.numa, max_nodes=1),
        numa_balance=dataclasses.replace(on.numa_balance, enabled=False))
    node.racing.other_cycle = NumaBalanceLoop(
        lambda: binding_only, node.state, node.plain, layout_for(node.plain), node.audit,
        notes=node.notes).cycle
    config = binding_only
    binding = NumaBindingLoop(lambda: config, node.state, node.racing, layout_for(node.racing),
                              node.audit, notes=node.notes)

    binding.cycle(0.0)
    node.racing.other_ended()
    config = dataclasses.replace(binding_only, numa=dataclasses.replace(on.numa, enabled=False))
    binding.cycle(0.0)

    assert (node.cpuset / "cpuset.mems").read_text().strip() == "0"
