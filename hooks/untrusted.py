"""Untrusted text on its way into a log line or an audit record, bounded.

Annotation values, names and ids from the runtime, and the contents of files quoted in error
messages come from outside the agent: any of them can be megabytes long or carry control
characters. :func:`bounded` keeps a short prefix with control characters escaped, and for text
that was cut adds its full length and a short hash, so an operator can still tell two values
apart and find the original, while no record grows with the input.
"""

from __future__ import annotations

import hashlib

PREFIX_CHARS = 128
"""Characters of an untrusted string kept in a record: enough for any real name, uid or value."""


def _escaped(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def bounded(text: str, limit: int = PREFIX_CHARS) -> str:
    """``text`` as it may appear in a record: unchanged when short and printable, else its first
    ``limit`` characters escaped, followed by ``… (N chars, sha256 XXXXXXXXXXXX)`` when cut."""
    if len(text) <= limit:
        # The common case (a short, printable name) costs two checks: it is on every event.
        return text if text.isprintable() else _escaped(text)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{_escaped(text[:limit])}… ({len(text)} chars, sha256 {digest})"


def bounded_repr(text: str, limit: int = PREFIX_CHARS) -> str:
    """:func:`bounded` in quotes, for quoting a value inside a sentence."""
    return f"'{bounded(text, limit)}'"
