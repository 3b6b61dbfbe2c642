"""Builders of what the policies are handed: a pod as ``hooks.model`` describes it, the
annotation a pod claims its QoS level with, and an OCI hook executable the agent accepts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from common.podmeta import PodMeta
from hooks.config_fields import frozen_map
from hooks.model import PodInfo

# The agent's own level annotation (``[qos] annotation``'s default).
LEVEL = "qos.nri-qos.io/level"
UID = "3f1c2a9e-0b7d-4a51-9c1e-5d2f6a7b8c90"


def pod(annotations: Mapping[str, str] | None = None, *, uid: str = UID,
        labels: Mapping[str, str] | None = None, namespace: str = "ns",
        cgroup_parent: str = "") -> PodInfo:
    """A pod named ``p`` in sandbox ``sb``; unless given, its uid is :data:`UID` and it has no
    annotations, no labels and no cgroup parent."""
    return PodInfo(id="sb", uid=uid, name="p", namespace=namespace,
                   labels=frozen_map(labels or {}), annotations=frozen_map(annotations or {}),
                   cgroup_parent=cgroup_parent)


def claiming_pod(uid: str, tier: str, level: str) -> PodInfo:
    """A pod of namespace ``test`` under kubelet's cgroup of ``tier``, claiming ``level``."""
    return PodInfo(id=f"sb-{uid}", uid=uid, name=level, namespace="test",
                   cgroup_parent=f"/kubepods/{tier}/pod{uid}", annotations={LEVEL: level})


def api_pod(uid: str, name: str, annotations: Mapping[str, str], *,
            memory_requests: Mapping[str, int] | None = None,
            memory_limits: Mapping[str, int] | None = None) -> PodMeta:
    """The API server's view of pod ``name`` (``uid``, namespace ``default``) with
    ``annotations``, no labels, priority and, unless given, no memory requests or limits (by
    container name)."""
    return PodMeta(uid=uid, namespace="default", name=name, annotations=frozen_map(annotations),
                   labels=frozen_map({}), priority=0,
                   memory_requests=frozen_map(memory_requests or {}),
                   memory_limits=frozen_map(memory_limits or {}))


def hook_executable(path: Path) -> Path:
    """A script at ``path`` that exits 0, owned by root and writable by root only: what the
    configuration's checks of an OCI hook executable accept."""
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    os.chown(path, 0, 0)
    return path
