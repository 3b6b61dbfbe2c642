"""Parsing a JSON document that came from outside the process (the API server, a credential
plugin, the status socket, the state file)."""

from __future__ import annotations

import json
from typing import Any


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads``, with a document nested deeper than the parser's recursion limit a
    ``ValueError`` like any other malformed one: the standard parser raises ``RecursionError``
    for it, which the callers' handling of bad input would not catch, so a few kilobytes of
    brackets would end the caller's task instead of being refused."""
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise ValueError(f"JSON nested too deeply to parse: {exc}") from exc
