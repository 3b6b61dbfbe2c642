"""Kubernetes label selectors in their string form, for the eviction manager's exclusion list.

The grammar is the one ``kubectl -l`` accepts: requirements joined by commas (all must hold),
each one of ``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``,
``key in (v1,v2)`` and ``key notin (v1,v2)``. As in Kubernetes, ``!=`` and ``notin`` also match
a pod that does not have the key. Keys are ``[prefix/]name`` (prefix a DNS subdomain of up to
253 characters, name up to 63 characters of letters, digits, ``-``, ``_``, ``.``, starting and
ending alphanumeric); values follow the name rule and may be empty.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?"
_KEY = re.compile(rf"(?:{_PREFIX}/)?{_NAME}")
_VALUE = re.compile(rf"(?:{_NAME})?")
_SET = re.compile(r"^(?P<key>\S+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_COMPARE = re.compile(r"^(?P<key>[^=!\s]+)\s*(?P<op>==|=|!=)\s*(?P<value>\S*)$")


class SelectorError(ValueError):
    """A selector that does not parse."""


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    # "exists", "!exists", "in", "notin"; = and != are "in"/"notin" with one value.
    op: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op == "in":
            return present and labels[self.key] in self.values
        return not present or labels[self.key] not in self.values


@dataclass(frozen=True, slots=True)
class Selector:
    text: str
    requirements: tuple[Requirement, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)


def _split(text: str) -> list[str]:
    """Requirements: commas outside parentheses separate them."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError("unbalanced ')'")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise SelectorError("unbalanced '('")
    parts.append("".join(current))
    return [p.strip() for p in parts]


def _key(text: str) -> str:
    if not _KEY.fullmatch(text):
        raise SelectorError(f"invalid label key {text!r}")
    return text


def _value(text: str) -> str:
    if not _VALUE.fullmatch(text):
        raise SelectorError(f"invalid label value {text!r}")
    return text


def _requirement(text: str) -> Requirement:
    if not text:
        raise SelectorError("empty requirement")
    if m := _SET.match(text):
        values = [v.strip() for v in m["values"].split(",")]
        if values == [""]:
            raise SelectorError(f"{m['op']} needs at least one value: {text!r}")
        return Requirement(_key(m["key"]), m["op"], frozenset(_value(v) for v in values))
    if m := _COMPARE.match(text):
        op = "notin" if m["op"] == "!=" else "in"
        return Requirement(_key(m["key"]), op, frozenset({_value(m["value"])}))
    if text.startswith("!"):
        return Requirement(_key(text[1:].strip()), "!exists")
    return Requirement(_key(text), "exists")


def parse_selector(text: str) -> Selector:
    """A selector from its string form; raises :class:`SelectorError`. The empty selector (which
    would match every pod) is refused."""
    if not text.strip():
        raise SelectorError("empty selector (it would match every pod)")
    return Selector(text, tuple(_requirement(part) for part in _split(text)))


def label_keys(texts: Iterable[str]) -> frozenset[str]:
    """The label keys the selectors ``texts`` read (an unparsable one reads none): the pods'
    labels are kept only under keys some policy reads, and a label left out would make
    ``key=value`` spare nothing and ``key!=value`` spare every pod."""
    keys: set[str] = set()
    for text in texts:
        try:
            keys.update(r.key for r in parse_selector(text).requirements)
        except SelectorError:
            continue
    return frozenset(keys)


def check_selectors(value: object) -> str | None:
    """Config check of a tuple of selectors: the first problem, or None."""
    if not isinstance(value, tuple):
        return "must be an array of label selectors"
    for item in value:
        try:
            parse_selector(str(item))
        except SelectorError as exc:
            return f"label selector {item!r}: {exc}"
    return None
