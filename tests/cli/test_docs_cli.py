"""The command lines the README and the docs show are ones the commands take: every ``nri-qos``
and ``nri-qos-hook`` command they name exists and every option they give it is one of its own,
and the README's table of commands lists every command there is."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from nri_plugin.cli.hook import _parser as hook_parser
from nri_plugin.cli.nri_qos import build_parser
from tests.support.paths import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Where a shell line stops being the command: a pipe, a redirection, the next command.
ENDS = {"|", "||", "&&", ";", ">", "2>", "<", "2>&1"}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


PROGRAMS = {"nri-qos": build_parser(), "nri-qos-hook": hook_parser()}


def code(text: str) -> Iterator[str]:
    """The code of a Markdown text: each line of a fenced block and each inline code span (one
    may run on over a line break)."""
    fenced, prose = False, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            yield line
        else:
            # A table cell escapes the pipe of a usage line's alternatives.
            prose.append(line.replace("\\|", "|"))
    yield from (span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", "\n".join(prose)))


def invocations() -> Iterator[tuple[str, str, str, list[str]]]:
    """(document, program, command, options given) of every command line shown."""
    for path in DOCUMENTS:
        for snippet in code(path.read_text(encoding="utf-8")):
            tokens = snippet.split()
            for i, token in enumerate(tokens):
                if token not in PROGRAMS or i + 1 >= len(tokens):
                    continue
                # `journalctl -u nri-qos` names the unit, not the command.
                if i and tokens[i - 1].startswith("-"):
                    continue
                command, given, depth = tokens[i + 1], [], 0
                if command.startswith("-"):
                    command = ""
                    rest = tokens[i + 1:]
                else:
                    rest = tokens[i + 2:]
                for word in rest:
                    if depth == 0 and word in ENDS:
                        break
                    depth += word.count("[") - word.count("]")
                    flag = re.match(r"\[?(--?[a-z][a-z0-9-]*)", word)
                    if flag:
                        given.append(flag.group(1))
                yield str(path.relative_to(REPO)), token, command, given


def test_the_walk_finds_the_documented_command_lines() -> None:
    found = {(program, command) for _, program, command, _ in invocations()}
    assert {("nri-qos", "run"), ("nri-qos", "status"), ("nri-qos", "reset"),
            ("nri-qos-hook", "resctrl-join")} <= found


def test_every_documented_command_and_option_exists() -> None:
    problems = []
    for where, program, command, given in invocations():
        parser = PROGRAMS[program]
        commands = subcommands(parser)
        if command and command not in commands:
            # Prose in a code span ("nri-qos agents") names no command; a word the parser
            # could take for one must be one.
            if re.fullmatch(r"[a-z]+(-[a-z]+)+", command) or command in ("run", "status"):
                problems.append(f"{where}: {program} {command}: no such command")
            continue
        known = options(commands[command] if command else parser)
        problems += [f"{where}: {program} {command} {flag}: no such option"
                     for flag in given if flag not in known]
    assert problems == []


@pytest.mark.parametrize("command", sorted(subcommands(build_parser())))
def test_the_readme_lists_every_command(command: str) -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert re.search(rf"^\| `nri-qos {command}\b", readme, re.M), command
