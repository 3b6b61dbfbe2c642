"""Reading a JSON object out of a pod annotation, with the bounds every such annotation needs."""

from __future__ import annotations

import json
from typing import Any


def json_object(text: str, max_chars: int) -> tuple[dict[str, Any] | None, str | None]:
    """The annotation's JSON object, or None and the reason it is unusable.

    Annotations are pod-controlled input: the size is bounded before anything is parsed.
    """
    if len(text) > max_chars:
        return None, f"annotation longer than {max_chars} characters"
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return None, f"invalid JSON: {exc}"
    if not isinstance(doc, dict):
        return None, f"must be a JSON object, got {type(doc).__name__}"
    return doc, None
