"""Errors raised by the capability policies' callers.

Policies themselves never raise on bad pod input: they return their decision together with a
``problems`` tuple, so that the valid parts of an annotation still apply. A capability raises
:class:`InvalidInput` only when the node config asks for strict handling; the NRI stub turns it
into an error answer (which fails the pod or the container).
"""

from __future__ import annotations

from collections.abc import Sequence


class InvalidInput(ValueError):
    """Pod input a capability could not honour, under strict handling."""

    def __init__(self, capability: str, problems: Sequence[str]) -> None:
        self.capability = capability
        self.problems = tuple(problems)
        super().__init__(f"{capability}: " + "; ".join(self.problems))
