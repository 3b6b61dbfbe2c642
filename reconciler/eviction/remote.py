"""Out-of-tree plugins: gRPC servers on unix sockets in the plugin directory.

:class:`PluginDirectory` is the registry: every round it lists the directory, and a socket
``<name>.sock`` that appears is a plugin named ``<name>``; one that disappears is dropped. The
directory must belong to root or the agent's user and be writable by nobody else (otherwise
anyone could put a socket there, or swap one), else no plugin of it is used. A socket must
belong to root or to the agent's own user (a socket anyone could create would let anyone evict
pods), and its name must not be an in-tree plugin's. A socket replaced by a new one (the plugin
restarted) gets a fresh channel, so the client does not sit out a reconnect backoff. The owner
is checked again right before every call, so before any connection the call opens: a socket
swapped after it was listed is refused (kind ``refused``) until the next listing registers it
anew.

:class:`~reconciler.eviction.remote_plugin.RemotePlugin` adapts one socket to
:class:`~reconciler.eviction.api.EvictionPlugin` with ``grpc.aio`` on the daemon's event loop
(loaded with the first plugin found: a node without any does not carry gRPC). Every call carries
the configured deadline, so the plugin knows it too. Answers are checked before use: an enum
value the API does not define, a non-finite number, more pods than asked for, an unusable
condition name or grace period make the whole answer invalid. Failures become
:class:`PluginCallError` with a kind the audit record names (``deadline``, ``unavailable``,
``error``, ``invalid answer``, ``refused``).
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from common.audit import AuditLog
from hooks.levels import QosLevel
from hooks.untrusted import bounded
from protos import eviction_pb2 as pb
from reconciler.eviction.api import (
    PLUGIN_NAME,
    ActivePod,
    Condition,
    EvictPods,
    EvictRequest,
    MetType,
    Operator,
    ThresholdMet,
    TopPods,
)
from reconciler.kube import MIN_GRACE_S

if TYPE_CHECKING:
    from reconciler.eviction.remote_plugin import RemotePlugin

log = structlog.get_logger("nri_qos.eviction")

SOCKET_SUFFIX = ".sock"
CONDITION_NAME = re.compile(r"[A-Z][A-Za-z0-9]{0,62}")
KUBELET_CONDITIONS = frozenset({"Ready", "MemoryPressure", "DiskPressure", "PIDPressure",
                                "NetworkUnavailable"})
"""Condition types kubelet owns; a plugin may not set them."""
MAX_GRACE_S = 86_400
MAX_ANSWER_PODS = 10_000
MAX_MESSAGE_BYTES = 4 << 20
_LEVELS_TO_PB: Mapping[str, pb.QosLevel] = {
    QosLevel.RECLAIMED_CORES: pb.RECLAIMED_CORES,
    QosLevel.SHARED_CORES: pb.SHARED_CORES,
    QosLevel.DEDICATED_CORES: pb.DEDICATED_CORES,
    QosLevel.SYSTEM_CORES: pb.SYSTEM_CORES,
}
_MET = {pb.NOT_MET: MetType.NOT_MET, pb.SOFT_MET: MetType.SOFT_MET, pb.HARD_MET: MetType.HARD_MET}
_OPERATORS = {pb.OPERATOR_UNSPECIFIED: Operator.UNSPECIFIED, pb.LESS_THAN: Operator.LESS_THAN,
              pb.GREATER_THAN: Operator.GREATER_THAN}


class PluginCallError(Exception):
    """A call that gave no usable answer; ``kind`` is one of deadline, unavailable, error,
    invalid answer, refused."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def invalid(detail: str) -> PluginCallError:
    return PluginCallError("invalid answer", detail)


# ---- messages -------------------------------------------------------------------------------


def pod_message(pod: ActivePod) -> pb.Pod:
    message = pb.Pod(uid=pod.uid, namespace=pod.namespace, name=pod.name,
                     qos_level=_LEVELS_TO_PB.get(pod.qos_level, pb.QOS_LEVEL_UNSPECIFIED))
    if pod.priority is not None:
        message.priority = pod.priority
    if pod.memory_request_bytes is not None:
        message.memory_request_bytes = pod.memory_request_bytes
    if pod.memory_usage_bytes is not None:
        message.memory_usage_bytes = pod.memory_usage_bytes
    return message


def _condition(message: pb.Condition) -> Condition:
    if message.type not in (pb.NODE_CONDITION, pb.CONDITION_TYPE_UNSPECIFIED):
        raise invalid(f"condition type {message.type} (only node conditions exist)")
    name = message.name
    if not CONDITION_NAME.fullmatch(name):
        raise invalid(f"condition name {bounded(name)!r} is not CamelCase letters and digits")
    if name in KUBELET_CONDITIONS:
        raise invalid(f"condition {name} belongs to kubelet")
    return Condition(name, message.met)


def _grace(message: Any) -> int | None:
    if not message.HasField("grace_period_seconds"):
        return None
    value = int(message.grace_period_seconds)
    if not MIN_GRACE_S <= value <= MAX_GRACE_S:
        raise invalid(f"grace period {value} s is outside {MIN_GRACE_S}..{MAX_GRACE_S}")
    return value


def threshold_from(message: pb.ThresholdMetResponse) -> ThresholdMet:
    met = _MET.get(message.met_type)
    if met is None:
        raise invalid(f"met_type {message.met_type} is not a MetType")
    operator = _OPERATORS.get(message.threshold_operator)
    if operator is None:
        raise invalid(f"threshold_operator {message.threshold_operator} is not an operator")
    if not (math.isfinite(message.threshold_value) and math.isfinite(message.observed_value)):
        raise invalid("threshold or observed value is not a finite number")
    condition = _condition(message.condition) if message.HasField("condition") else None
    return ThresholdMet(met, message.threshold_value, message.observed_value, operator,
                        bounded(message.eviction_scope, 64), condition)


def top_pods_from(message: pb.GetTopEvictionPodsResponse, top_n: int) -> TopPods:
    uids = tuple(message.target_pod_uids)
    if len(uids) > top_n:
        raise invalid(f"{len(uids)} pods where at most {top_n} were asked for")
    return TopPods(uids, _grace(message))


def evict_pods_from(message: pb.GetEvictPodsResponse) -> EvictPods:
    if len(message.evict_pods) > MAX_ANSWER_PODS:
        raise invalid(f"{len(message.evict_pods)} pods (more than {MAX_ANSWER_PODS})")
    pods = []
    for item in message.evict_pods:
        if not item.uid:
            raise invalid("a pod without uid")
        pods.append(EvictRequest(item.uid, bounded(item.reason) or "no reason given",
                                 _grace(item), item.force))
    condition = _condition(message.condition) if message.HasField("condition") else None
    return EvictPods(tuple(pods), condition)


# ---- one plugin -----------------------------------------------------------------------------


def _identity(info: os.stat_result) -> tuple[int, int, int]:
    return (info.st_dev, info.st_ino, info.st_ctime_ns)


def _owner_problem(info: os.stat_result) -> str | None:
    """Why a file the agent takes orders from is not trusted, or None."""
    if info.st_uid not in (0, os.geteuid()):
        return f"owned by uid {info.st_uid}, not root or the agent's user"
    return None


def check_socket(path: str, listed: tuple[int, int, int]) -> None:
    """Raises :class:`PluginCallError` unless the socket at ``path`` is still the one listed
    (``listed``: its :func:`_identity` then) and still trusted: checked right before a call, and
    so before any connection gRPC opens for it."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise PluginCallError("unavailable", f"socket gone: {exc.strerror}") from None
    why = "not a unix socket" if not stat.S_ISSOCK(info.st_mode) else _owner_problem(info)
    if why is None and _identity(info) != listed:
        why = "the socket was replaced since it was listed"
    if why is not None:
        raise PluginCallError("refused", why)


def directory_problem(directory: str) -> str | None:
    """Why the plugin directory is not trusted, or None (it is, or it does not exist)."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory (a symbolic link is not followed)"
    owner = _owner_problem(info)
    if owner is not None:
        return owner
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by its group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


# ---- the directory --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Found:
    path: str
    # (device, inode, change time): a new socket under the same name is a restarted plugin (an
    # inode number alone may be reused at once).
    identity: tuple[int, int, int]


class PluginDirectory:
    """The out-of-tree plugins of one directory, kept in step with its sockets."""

    def __init__(self, audit: AuditLog, deadline: Callable[[], float]) -> None:
        self._audit = audit
        self._deadline = deadline
        self._plugins: dict[str, tuple[RemotePlugin, tuple[int, int, int]]] = {}
        # name -> reason, for sockets refused (audited once while they stay)
        self._refused: dict[str, str] = {}
        self._unreadable: str | None = None
        # Why the directory itself is not trusted (said once while it stays so).
        self._dir_refused: str | None = None

    @property
    def plugins(self) -> list[RemotePlugin]:
        return [plugin for _, (plugin, _) in sorted(self._plugins.items())]

    def _list(self, directory: str, reserved: Collection[str]) -> dict[str, _Found]:
        unsafe = directory_problem(directory)
        if unsafe is not None:
            if self._dir_refused != unsafe:
                log.error("eviction_plugin_dir_refused", path=directory, reason=unsafe,
                          hint="make it root-owned and not writable by group or others")
            self._dir_refused = unsafe
            return {}
        self._dir_refused = None
        try:
            names = os.listdir(directory)
            self._unreadable = None
        except FileNotFoundError:
            return {}
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc.strerror}"
            if self._unreadable != problem:
                self._unreadable = problem
                log.warning("eviction_plugin_dir_unreadable", path=directory, error=problem)
            return {}
        found: dict[str, _Found] = {}
        refused: dict[str, str] = {}
        for entry in names:
            if not entry.endswith(SOCKET_SUFFIX):
                continue
            name = entry.removesuffix(SOCKET_SUFFIX)
            path = os.path.join(directory, entry)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            owner = _owner_problem(info)
            if not stat.S_ISSOCK(info.st_mode):
                why = "not a unix socket"
            elif owner is not None:
                why = owner
            elif not PLUGIN_NAME.fullmatch(name):
                why = f"name is not {PLUGIN_NAME.pattern}"
            elif name in reserved:
                why = "name of an in-tree plugin"
            else:
                found[name] = _Found(path, _identity(info))
                continue
            refused[name] = why
        for name, why in refused.items():
            if self._refused.get(name) != why:
                self._audit.record("eviction_plugin_dropped", plugin=bounded(name),
                                   reason=f"refused: {why}", socket=bounded(entry_path(
                                       directory, name)))
        self._refused = refused
        return found

    async def scan(self, directory: str, reserved: Collection[str]) -> list[RemotePlugin]:
        """Registers new sockets, drops vanished ones; the plugins in name order."""
        found = self._list(directory, reserved)
        for name in [n for n in self._plugins if n not in found]:
            plugin, _ = self._plugins.pop(name)
            await plugin.close()
            reason = "socket removed" if self._dir_refused is None \
                else f"directory refused: {self._dir_refused}"
            self._audit.record("eviction_plugin_dropped", plugin=name, reason=reason,
                               socket=plugin.path)
        for name, where in sorted(found.items()):
            known = self._plugins.get(name)
            if known is not None and known[1] == where.identity:
                continue
            if known is not None:
                await known[0].close()
                log.info("eviction_plugin_restarted", plugin=name, socket=where.path)
            else:
                self._audit.record("eviction_plugin_registered", plugin=name, socket=where.path)
            # gRPC is loaded with the first plugin: a node without any (most) does not carry
            # its library (about 10 MiB of the agent's memory, ``bench/agent_idle.py``).
            from reconciler.eviction.remote_plugin import RemotePlugin

            self._plugins[name] = (RemotePlugin(name, where.path, self._deadline,
                                                where.identity), where.identity)
        return self.plugins

    async def close(self) -> None:
        plugins, self._plugins = list(self._plugins.values()), {}
        for plugin, _ in plugins:
            await plugin.close()


def entry_path(directory: str, name: str) -> str:
    return os.path.join(directory, name + SOCKET_SUFFIX)
