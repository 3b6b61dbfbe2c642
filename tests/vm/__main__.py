"""``python -m tests.vm [--numa N] [--mem-mib PER_NODE] [--cgroup v2|v1] [...] -- COMMAND...``

Runs COMMAND in a fresh guest (a real Debian kernel under QEMU) from the current directory, with
the host's Python and virtualenv, prints its output as it comes and exits with its status (125
when the guest did not run it to its end, with the guest's console to say why). Everything else
the guest wrote is gone with it, except the files COMMAND leaves under ``$NRIQOS_VM_ARTIFACTS``,
which ``--save DIR`` copies to DIR on the host.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.vm.machine import Guest, main


def parse(argv: list[str]) -> tuple[Guest, list[str], float, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m tests.vm", description=__doc__.split("\n")[2])
    parser.add_argument("--numa", type=int, default=1, help="NUMA nodes (default 1)")
    parser.add_argument("--mem-mib", type=int, default=2048,
                        help="memory per NUMA node in MiB (default 2048)")
    parser.add_argument("--cgroup", choices=("v2", "v1"), default="v2",
                        help="cgroup version (default v2)")
    parser.add_argument("--disk", action="store_true",
                        help="an 8 GiB scratch ext4 disk at /var/tmp (and TMPDIR there)")
    parser.add_argument("--cpus", type=int, default=2, help="virtual CPUs (default 2)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds before the guest is killed (default 1800)")
    parser.add_argument("--save", type=Path, metavar="DIR",
                        help="copy the files COMMAND leaves under $NRIQOS_VM_ARTIFACTS here "
                             "(a directory on the host, made if missing)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: python -m tests.vm [options] -- COMMAND...")
    try:
        guest = Guest(numa=args.numa, mem_mib=args.mem_mib, cgroup=args.cgroup, disk=args.disk,
                      cpus=args.cpus)
    except ValueError as exc:
        parser.error(str(exc))
    return guest, command, args.timeout, args.save


if __name__ == "__main__":
    sys.exit(main(*parse(sys.argv[1:])))
