"""``nri-qos status``: ask the running agent what it is doing, over its local status socket.

The socket is ``--status-socket``, else ``[status] socket`` of the configuration (``--config``
or the default file with its drop-ins). The agent writes one JSON document
(:mod:`nri_plugin.report.status`) and closes; this command prints it for a person, or as it is with
``--json``. Exit status: 0 when the agent answered, 1 when no agent answers (or the answer is
unusable), 2 for an invalid configuration; with ``--json`` the failures are JSON too
(``{"running": false, "error": ...}``).
"""

from __future__ import annotations

import io
import json
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from common import jsondoc
from hooks.units import quantity
from hooks.untrusted import bounded
from nri_plugin.config.loader import ConfigError
from nri_plugin.config.store import load_config

CONNECT_TIMEOUT_S = 5.0
MAX_DOCUMENT_BYTES = 16 << 20


class NoAgent(Exception):
    """Nothing usable answered on the status socket."""


def fetch(path: str, *, timeout_s: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
    """The agent's status document; raises :class:`NoAgent` with a message for a person."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise NoAgent(
                f"no nri-qos agent is running: nothing answers on the status socket {path} "
                f"({exc.strerror}). Start it with `nri-qos run` (or check the DaemonSet's pod on "
                "this node); if it uses another status socket, pass the agent's --config PATH "
                "or --status-socket PATH (not the NRI socket of `run --nri-socket`).") from exc
        except PermissionError as exc:
            raise NoAgent(f"permission denied on {path}: the status socket is root-only; run "
                          "`nri-qos status` as root.") from exc
        except OSError as exc:
            raise NoAgent(f"cannot connect to {path}: {exc}") from exc
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := sock.recv(1 << 16):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_DOCUMENT_BYTES:
                    raise NoAgent(f"the answer on {path} exceeds {MAX_DOCUMENT_BYTES} bytes")
        except TimeoutError as exc:
            raise NoAgent(f"the agent on {path} did not answer within {timeout_s} s") from exc
        except OSError as exc:
            # The agent stopped (or was restarted) while it answered: reset, broken pipe.
            raise NoAgent(f"the connection to the agent on {path} broke before its answer "
                          f"was whole: {exc}") from exc
    finally:
        sock.close()
    try:
        document = jsondoc.loads(b"".join(chunks))
    except ValueError as exc:
        raise NoAgent(f"the answer on {path} is not a status document: {exc}") from exc
    if not isinstance(document, dict):
        raise NoAgent(f"the answer on {path} is not a status document")
    if "error" in document:
        raise NoAgent(f"the agent answered with an error: {document['error']}")
    return document


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms ago"
    if seconds < 120:
        return f"{seconds:.1f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _since(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def _ladder(out: TextIO, ladder: dict[str, Any] | None) -> None:
    title = "mitigation ladder"
    if ladder is None:
        out.write(f"{title:<18}not running\n")
        return
    engaged = ", ".join(ladder["engaged"]) or "no rung engaged"
    out.write(f"{title:<18}level {ladder['level']} ({ladder['cause']}); {engaged}\n")
    for rung, last in ladder["last"].items():
        out.write(f"  {rung:<16} last {last['step']}: {last['result']} ({last['detail']})\n")


def _listing(out: TextIO, title: str, items: list[dict[str, Any]] | None,
             line: Callable[[dict[str, Any]], str]) -> None:
    if items is None:
        out.write(f"{title:<18}not running\n")
        return
    out.write(f"{title:<18}{'none' if not items else ''}\n")
    for item in items:
        out.write(f"  {line(item)}\n")


def print_status(doc: dict[str, Any], out: TextIO) -> None:
    agent, conn = doc["agent"], doc["connection"]
    out.write(f"agent             nri-qos {agent['version']} (pid {agent['pid']}, plugin "
              f"{agent['plugin']}), up {agent['uptime_s']:.0f} s, config {agent['config']}\n")
    out.write(f"mode              {agent['mode']}\n")
    refused = agent.get("config_refused", [])
    if refused:
        out.write("config refused    the files' latest version; the previous configuration "
                  "stays in force:\n")
        for error in refused:
            out.write(f"  {error}\n")
    # Not in the answer of every agent version: none when missing.
    for key, values in agent.get("restart_needed", {}).items():
        out.write(f"restart needed    {key} = {json.dumps(values['new'])} at the next start "
                  f"({json.dumps(values['in_force'])} in force)\n")
    out.write(f"connection        {conn['state']} since {_since(conn['since_unix'])} "
              f"({conn['for_s']:.1f} s); {conn['connections']} connection(s) so far\n")
    runtime = doc.get("runtime")
    if runtime is None:
        out.write("runtime           none (not connected)\n")
    else:
        out.write(f"runtime           {runtime['name']} {runtime['version']}, NRI "
                  f"{runtime['nri_version']}, request timeout {runtime['request_timeout_ms']} ms\n")
        out.write(f"events            {', '.join(runtime['events'])} "
                  f"(mask {runtime['event_mask']})\n")
    node = doc["node"]
    levels = ", ".join(f"{n} {level}" for level, n in node["pods_by_level"].items()) or "none"
    out.write(f"node              {node['pods']} pods ({levels}), {node['containers']} "
              f"containers, {node['running_containers']} running"
              f"{'' if node['synchronized'] else '; not synchronized yet'}\n")
    out.write("features\n")
    for name, feature in doc["features"].items():
        out.write(f"  {'on ' if feature['runs'] else 'off'} {name:<26} {feature['detail']}\n")
    reconciler = doc["reconciler"]
    if reconciler.get("waiting_for"):
        out.write(f"reconciler        waiting for {reconciler['waiting_for']}\n")
    elif not reconciler["running"]:
        out.write("reconciler        not running\n")
    else:
        out.write("reconciler loops\n")
        if not reconciler["loops"]:
            out.write("  no cycle yet\n")
        for name, loop in reconciler["loops"].items():
            line = (f"  {name:<16} last cycle {_ago(loop['ago_s'])}, took "
                    f"{loop['duration_ms']:.1f} ms; {loop['cycles']} cycles, "
                    f"{loop['failures']} failed")
            if loop["failed"]:
                line += f"; LAST CYCLE FAILED: {loop['last_error']}"
            out.write(line + "\n")
    detection = doc["detection"]
    out.write(f"detector levels   {'no readings' if not detection else ''}\n")
    for reading in detection:
        why = f" ({reading['reason']})" if reading["reason"] else ""
        unit = reading["unit"]
        out.write(f"  {reading['detector']:<16} {reading['scope']:<24} {reading['level']:<8} "
                  f"{quantity(reading['value'], unit)} "
                  f"(threshold {quantity(reading['threshold'], unit)}){why}\n")
    _ladder(out, doc.get("mitigation"))
    _listing(out, "last evictions", doc.get("evictions"), lambda e: (
        f"{e['pod']} {e['outcome']} ({e['plugin']}: {e['reason']}) {_ago(e['ago_s'])}"))
    _listing(out, "taints", doc.get("taints"), lambda t: (
        f"{t['key']}={t['value']}:{t['effect']} for {t['for_s']:.0f} s"))


def _json_failure(out: TextIO, error: str, socket: str | None = None) -> None:
    """What a script reading ``--json`` gets when there is no document: still JSON."""
    failure: dict[str, Any] = {"running": False, "error": error}
    if socket is not None:
        failure["socket"] = socket
    out.write(json.dumps(failure, sort_keys=True) + "\n")


def main_status(config_path: str | None, socket: str | None, *, as_json: bool,
                out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    if socket is None:
        try:
            cfg, source = load_config(config_path)
        except ConfigError as exc:
            if as_json:
                _json_failure(out, "; ".join(exc.lines()))
            for line in exc.lines():
                err.write(f"{line}\n")
            return 2
        socket = cfg.status.socket
        if not cfg.status.enabled:
            # Whether an agent runs or not, none of this configuration answers there.
            off = (f"the configuration ({source}) turns the status socket off ([status] "
                   "enabled = false): an agent running with it answers no status")
            if as_json:
                _json_failure(out, off, socket)
            err.write(f"nri-qos status: {off}\n")
            return 1
    try:
        document = fetch(socket)
    except NoAgent as exc:
        if as_json:
            _json_failure(out, str(exc), socket)
        err.write(f"nri-qos status: {exc}\n")
        return 1
    # Printed whole or not at all: a JSON object from something else on the socket (or a
    # document this command cannot read) is refused like any other unusable answer, in both
    # forms (a script reading --json must not take it for the agent's).
    text = io.StringIO()
    try:
        print_status(document, text)
    except (LookupError, TypeError, AttributeError, ValueError, OverflowError) as exc:
        message = (f"the answer on {socket} is not a status document this command can read "
                   f"({type(exc).__name__}: {bounded(str(exc))})")
        if as_json:
            _json_failure(out, message, socket)
        err.write(f"nri-qos status: {message}\n")
        return 1
    out.write(json.dumps(document, indent=2, sort_keys=True) + "\n" if as_json
              else text.getvalue())
    return 0
