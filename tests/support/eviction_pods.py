"""Pods shared by the eviction manager's tests."""

from __future__ import annotations

from reconciler.eviction.api import ActivePod

GIB = 1 << 30


def pod(uid: str = "u", *, level: str = "reclaimed_cores", priority: int | None = 0,
        usage: int | None = GIB, namespace: str = "batch", request: int | None = GIB,
        ) -> ActivePod:
    return ActivePod(uid, namespace, f"pod-{uid}", level, priority, request, usage)
