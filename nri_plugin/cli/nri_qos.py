"""The ``nri-qos`` command's parser and dispatch: run the agent, simulate a runtime, probe the
host, ask the running agent for its status, check or print the configuration, reset the node."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from nri_plugin.config.render import render_toml
from nri_plugin.config.schema import Config
from nri_plugin.config.store import DEFAULT_CONFIG_PATH
from nri_plugin.obs.logs import LEVELS
from nri_plugin.version import agent_version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nri-qos",
        description="containerd NRI plugin colocating online and offline workloads.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {agent_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    config_help = f"configuration file (default {DEFAULT_CONFIG_PATH}; embedded defaults if absent)"
    level_help = "log level, overriding [logging] level"

    run = commands.add_parser("run", help="run the plugin (connects to the runtime's NRI socket)")
    run.add_argument("--config", metavar="PATH", help=config_help)
    run.add_argument("--nri-socket", "--socket", dest="nri_socket", metavar="PATH",
                     help="the runtime's NRI socket, overriding [plugin] socket (--socket is "
                          "the same option, under its older name)")
    run.add_argument("--log-level", choices=tuple(LEVELS), help=level_help)
    run.add_argument("--metrics-address", metavar="ADDRESS",
                     help="listen address of the metrics endpoint, overriding [metrics] address "
                          "(the DaemonSet passes the pod's IP)")
    run.add_argument("--allow-second-agent", action="store_true",
                     help="start even when another agent answers on the status socket (two "
                          "agents adjust every container twice; for a takeover only)")

    simulate = commands.add_parser(
        "simulate", help="play a scenario against the plugin with a built-in runtime simulator"
    )
    simulate.add_argument("scenario", nargs="?", metavar="SCENARIO",
                          help="scenario file (default: the bundled one)")
    simulate.add_argument("--config", metavar="PATH", help=config_help)
    simulate.add_argument("--log-level", choices=tuple(LEVELS), help=level_help)
    simulate.add_argument("--runtime", metavar="NAME/VERSION",
                          help="impersonate this runtime, e.g. containerd/v1.7.27 "
                               "(default: the scenario's)")
    simulate.add_argument("--nri-version", metavar="VERSION",
                          help="the NRI version the runtime states (default: what that runtime "
                               "release sends)")
    simulate.add_argument("--cgroup", choices=("v1", "v2"),
                          help="preview the answers of a host of this cgroup version (default: "
                               "this host's, or [memory] cgroup_version)")
    simulate.add_argument("--json", action="store_true",
                          help="one JSON object per answer, without the header")

    probe = commands.add_parser(
        "probe", help="print what the agent sees on this host and which features will run"
    )
    probe.add_argument("--config", metavar="PATH", help=config_help)
    probe.add_argument("--json", action="store_true", help="machine-readable output")

    status = commands.add_parser(
        "status", help="ask the running agent what it is doing (over its local status socket)"
    )
    status.add_argument("--config", metavar="PATH",
                        help=config_help.replace("configuration file", "configuration file naming "
                                                 "the socket ([status] socket)"))
    status.add_argument("--status-socket", metavar="PATH",
                        help="the agent's status socket, overriding [status] socket of the "
                             "configuration")
    status.add_argument("--json", action="store_true", help="machine-readable output")

    check = commands.add_parser(
        "check-config",
        help="validate a configuration file; print the effective configuration or every error",
    )
    check.add_argument("path", nargs="?", metavar="PATH",
                       help=f"file to check (default {DEFAULT_CONFIG_PATH})")

    commands.add_parser("default-config", help="print the commented default configuration")

    reset = commands.add_parser(
        "reset", help="take off this node everything the agent placed (the uninstall step)")
    reset.add_argument("--config", metavar="PATH", help=config_help)
    reset.add_argument("--dry-run", action="store_true",
                       help="print what would be undone, change nothing")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command; a reader that goes away early (``nri-qos status | head -1``) ends it
    quietly, with the status of a process killed by SIGPIPE, as other Unix tools end."""
    try:
        code = _dispatch(argv)
        # Inside the try: what is still buffered is written here, not at interpreter exit.
        sys.stdout.flush()
    except BrokenPipeError:
        # Nothing more may reach the closed pipe, not even the interpreter's final flush.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    return code


def _dispatch(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        from nri_plugin.cli.daemon import main_run

        return main_run(args.config, args.nri_socket, args.log_level,
                        allow_second_agent=args.allow_second_agent,
                        metrics_address=args.metrics_address)
    if args.command == "simulate":
        from nri_plugin.cli.simulate import main_simulate

        return main_simulate(args.scenario, args.config, args.log_level, args.runtime,
                             args.nri_version, cgroup=args.cgroup, as_json=args.json)
    if args.command == "probe":
        from nri_plugin.cli.probe import main_probe

        return main_probe(args.config, as_json=args.json)
    if args.command == "status":
        from nri_plugin.cli.status import main_status

        return main_status(args.config, args.status_socket, as_json=args.json)
    if args.command == "check-config":
        from nri_plugin.cli.check_config import check_config

        return check_config(args.path)
    if args.command == "reset":
        from nri_plugin.cli.reset import main_reset

        return main_reset(args.config, dry_run=args.dry_run)
    if args.command == "default-config":
        sys.stdout.write(render_toml(Config(), commented=True))
        return 0
    parser.print_help(sys.stderr)
    return 2
