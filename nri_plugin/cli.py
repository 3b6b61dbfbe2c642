"""The ``nri-qos`` command: run the agent, simulate a runtime, probe the host, ask the running
agent for its status, check or print the configuration."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nri_plugin.config.loader import ConfigError
from nri_plugin.config.render import render_toml
from nri_plugin.config.schema import Config
from nri_plugin.config.store import DEFAULT_CONFIG_PATH, EMBEDDED_DEFAULTS, load_config
from nri_plugin.logs import LEVELS
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
    run.add_argument("--socket", metavar="PATH", help="NRI socket, overriding [plugin] socket")
    run.add_argument("--log-level", choices=tuple(LEVELS), help=level_help)

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
    status.add_argument("--socket", metavar="PATH", help="status socket, overriding the config")
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


def check_config(path: str | None) -> int:
    try:
        cfg, source = load_config(path)
    except ConfigError as exc:
        where = exc.source or path or DEFAULT_CONFIG_PATH
        for error in exc.errors:
            print(f"{where}: {error}", file=sys.stderr)
        print(f"{where}: invalid configuration ({len(exc.errors)} "
              f"error{'s' if len(exc.errors) != 1 else ''})", file=sys.stderr)
        return 1
    if source == EMBEDDED_DEFAULTS:
        print(f"no file at {DEFAULT_CONFIG_PATH}: the embedded defaults apply", file=sys.stderr)
    sys.stdout.write(render_toml(cfg, commented=False))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        from nri_plugin.daemon import main_run

        return main_run(args.config, args.socket, args.log_level)
    if args.command == "simulate":
        from nri_plugin.simulate import main_simulate

        return main_simulate(args.scenario, args.config, args.log_level, args.runtime,
                             args.nri_version)
    if args.command == "probe":
        from nri_plugin.probe_command import main_probe

        return main_probe(args.config, as_json=args.json)
    if args.command == "status":
        from nri_plugin.status_command import main_status

        return main_status(args.config, args.socket, as_json=args.json)
    if args.command == "check-config":
        return check_config(args.path)
    if args.command == "reset":
        from nri_plugin.reset_command import main_reset

        return main_reset(args.config, dry_run=args.dry_run)
    if args.command == "default-config":
        sys.stdout.write(render_toml(Config(), commented=True))
        return 0
    parser.print_help(sys.stderr)
    return 2
