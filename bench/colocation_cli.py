"""The colocation benchmark's command line: its options, and the settings of a run from them and
a scenario (:mod:`bench.colocation_plan`). Pure: what the machine is comes in as arguments."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from bench.baselines import ALONE, MODES, modes_for
from bench.colocation_plan import (
    SCENARIOS,
    Scenario,
    Settings,
    anon_peak_mib,
    default_input_mib,
    online_held_mib,
)
from nri_plugin.config.loader import ConfigError, parse_toml
from nri_plugin.config.schema import Config

WHOLE_MACHINE_SHARE = (0.85, 1.05)
"""A machine counts as a scenario's whole node when its memory (MemTotal: what the kernel left
of the RAM) is within these shares of the scenario's node size."""


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--scenario", default="main", choices=sorted(SCENARIOS),
                   help="the node and workloads (default main; --list-scenarios says what each "
                        "is); the options below override it")
    p.add_argument("--list-scenarios", action="store_true", help="list the scenarios and exit")
    p.add_argument("--duration", type=float, default=90.0,
                   help="seconds of each repetition's window (the offline job's run)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each mode")
    p.add_argument("--quick", action="store_true",
                   help="a short run: 20 s windows, one counted block after the warm-up")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated, of " + ", ".join(MODES) + " (kubelet-memoryqos only "
                        "where the memory controller is cgroup v2), or " + ALONE + " (the "
                        "online pod with no offline pod: the floor of its tail; only when "
                        "named); default: all but " + ALONE)
    p.add_argument("--seed", type=int, help="of the blocks' order (default: drawn, and printed)")
    p.add_argument("--idle-s", type=float, default=5.0,
                   help="idle time after the caches are dropped, before each repetition")
    p.add_argument("--node-mib", type=int, help="the node's memory (default: the scenario's)")
    p.add_argument("--reserved-mib", type=int, default=256,
                   help="the node's memory kept from kubepods (system reserved)")
    p.add_argument("--online-files-mib", type=int)
    p.add_argument("--online-anon-mib", type=int,
                   help="anonymous memory of the online probe, and of the online service")
    p.add_argument("--online-rps", type=float, default=200.0,
                   help="the online key-value service's open-loop arrival rate (0: no service)")
    p.add_argument("--service-timeout-ms", type=float, default=1000.0,
                   help="a request not answered within this is missed")
    p.add_argument("--offline-anon-mib", type=int)
    p.add_argument("--offline-grow-mib-s", type=float)
    p.add_argument("--offline-task-s", type=float,
                   help="each task of the offline job grows its buffer, then frees it")
    p.add_argument("--offline-input-mib", type=int,
                   help="the offline pods' data set (all pods together), read over and over; "
                        "default: computed from the node and what the online pod holds "
                        "(printed)")
    p.add_argument("--offline-work-rounds", type=int, default=1,
                   help="SHA-256 rounds per MiB the offline job reads (its CPU work)")
    p.add_argument("--offline-warm", action=argparse.BooleanOptionalAction,
                   help="open each window once every offline pod has read its data set through "
                        "(its page cache filling the node); default: the scenario's")
    p.add_argument("--offline-write-every", type=int, default=8,
                   help="the offline job writes 1 MiB per this many MiB read")
    p.add_argument("--agent-from", default="",
                   help="run the agent from this source tree (python -m nri_plugin there), to "
                        "compare versions; default: this one")
    p.add_argument("--agent-config", default="",
                   help="a TOML file of settings over the defaults for every agent mode (a "
                        "drop-in of the agent's configuration); checked before the run")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=TOML",
                   help="one more mode, agent+NAME: the full agent with the settings of this "
                        "file over the defaults (and over --agent-config), run in the same "
                        "blocks as the others; checked before the run; may be repeated")
    p.add_argument("--data-dir", help="where the data files are kept (reused when there); "
                                      "default: this run's directory under /var/tmp")
    p.add_argument("--keep", help="keep each repetition's work directory (agent log, audit "
                                  "trail, raw samples; not the offline pods' output) under "
                                  "this directory; it holds the run's unix sockets, so it "
                                  "must be on a local file system (checked before the run)")
    p.add_argument("--trace-stalls", action="store_true",
                   help="sample what the machine's tasks do (state, wait channel, CPU) every "
                        "200 ms and print, for each stall of the service (a request 300 ms late "
                        "or more), what they did over it; costs the machine some CPU")
    p.add_argument("--profile-agent", action="store_true",
                   help="profile every thread of each agent against its own CPU clock into its "
                        "work directory (needs --keep; the agent runs two to three times "
                        "slower; summed by 'python bench/agent_profile.py report DIR')")
    p.add_argument("--plot", help="draw the latency CDFs and offline progress into this PNG")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--from-json", help="print (and --plot) earlier raw results; no run")
    return p


def agent_drop_in(path: str, option: str = "--agent-config") -> str:
    """The text of a drop-in file given as ``option`` ("" for none), checked as the agent
    checks its configuration: a file it would refuse stops the benchmark before any run."""
    if not path:
        return ""
    try:
        text = Path(path).read_text()
        parse_toml(Config, text, path)
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"{option}: cannot read {path}: {exc}") from exc
    except ConfigError as exc:
        raise SystemExit(f"{option}: {exc}") from exc
    return text


def variants_from(given: list[str]) -> dict[str, str]:
    """``--variant NAME=TOML`` options: name -> the file's text, each file checked."""
    variants: dict[str, str] = {}
    for option in given:
        name, sep, path = option.partition("=")
        if not sep or not path:
            raise SystemExit(f"--variant {option}: expected NAME=TOML")
        variants[name] = agent_drop_in(path, f"--variant {name}")
    return variants


def list_scenarios() -> str:
    return "\n".join(f"{s.name:13} {s.node_mib} MiB node"
                     f"{' (the whole machine)' if s.whole_machine else ''}: {s.summary}"
                     for s in SCENARIOS.values())


def node_mib_for(scenario: Scenario, machine_mib: int) -> int:
    """The node's size: the scenario's, or the whole machine's memory where the scenario's node
    is a whole machine (then the machine must be about that size)."""
    if not scenario.whole_machine:
        return scenario.node_mib
    low, high = (int(share * scenario.node_mib) for share in WHOLE_MACHINE_SHARE)
    if not low <= machine_mib <= high:
        raise ValueError(
            f"scenario {scenario.name} needs a machine of about {scenario.node_mib} MiB (its whole "
            f"memory is the node; {low}-{high} MiB of MemTotal), this one has {machine_mib} MiB: "
            f"run it in a guest, e.g. python -m tests.vm --mem-mib {scenario.node_mib} --disk "
            f"-- python bench/colocation.py --scenario {scenario.name}")
    return machine_mib


def settings_from(args: argparse.Namespace, machine_mib: int, v2: bool) -> tuple[Settings, str]:
    """A run's settings from the options and the scenario, and how the offline data set was
    sized (a line to print)."""
    scenario = SCENARIOS[args.scenario]
    if args.profile_agent and not args.keep:
        raise ValueError("--profile-agent writes into each repetition's work directory: "
                         "give --keep too")

    def pick(value: float | None, default: float) -> float:
        return default if value is None else value

    node_mib = int(args.node_mib) if args.node_mib else node_mib_for(scenario, machine_mib)
    duration = 20.0 if args.quick else args.duration
    online_anon = int(pick(args.online_anon_mib, scenario.online_anon_mib))
    online_files = int(pick(args.online_files_mib, scenario.online_files_mib))
    anon = int(pick(args.offline_anon_mib, scenario.offline_anon_mib))
    grow = pick(args.offline_grow_mib_s, scenario.offline_grow_mib_s)
    task = pick(args.offline_task_s, scenario.offline_task_s)
    allocatable = node_mib - args.reserved_mib
    held = online_held_mib(online_anon, online_files, args.online_rps > 0)
    peak = anon_peak_mib(anon, grow, task, duration)
    sized, room = default_input_mib(allocatable, held, peak, scenario.offline_pods,
                                    scenario.input_share)
    input_mib = args.offline_input_mib or scenario.input_mib or sized
    source = ("given" if args.offline_input_mib else "the scenario's" if scenario.input_mib
              else f"{scenario.input_share:g} x the room")
    fits = input_mib <= room
    how = (f"offline data set {input_mib} MiB ({source}): "
           f"kubepods {allocatable} MiB less the online pod (~{held} MiB) and the offline "
           f"pods' anonymous peaks ({scenario.offline_pods} x ~{peak} MiB) leaves {room} MiB, "
           f"so it {'fits unmanaged' if fits else 'does not fit even unmanaged (it streams)'}; "
           f"it does not fit once the offline tier is capped below "
           f"{input_mib + scenario.offline_pods * peak} MiB")
    wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
    # The names checked (a ValueError) before the files are read.
    modes = modes_for(wanted, v2, [option.partition("=")[0] for option in args.variant])
    variants = variants_from(args.variant)
    settings = Settings(
        duration_s=duration, reps=1 if args.quick else args.reps, node_mib=node_mib,
        reserved_mib=args.reserved_mib, online_files_mib=online_files,
        online_anon_mib=online_anon, offline_anon_mib=anon, offline_grow_mib_s=grow,
        offline_task_s=task, offline_input_mib=input_mib,
        offline_write_every=args.offline_write_every,
        modes=modes,
        seed=args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31),
        idle_s=2.0 if args.quick else args.idle_s,
        agent_source=str(Path(args.agent_from).resolve()) if args.agent_from else "",
        agent_config=agent_drop_in(args.agent_config), variants=variants,
        scenario=scenario.name, offline_pods=scenario.offline_pods,
        offline_work_rounds=args.offline_work_rounds,
        offline_warm=scenario.warm if args.offline_warm is None else args.offline_warm,
        online_rps=args.online_rps,
        service_timeout_ms=args.service_timeout_ms, trace_stalls=args.trace_stalls,
        profile_agent=args.profile_agent)
    return settings, how
