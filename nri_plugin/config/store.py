"""The configuration in force, and its reloads.

:class:`ConfigStore` holds the current :class:`Config`. Components read ``store.current`` when
they need it (the object is frozen, so one event sees one consistent configuration), or subscribe
to hear about a new one. A reload validates the whole file first and swaps only a valid
configuration: an invalid file leaves the running one in force, with a ``config_rejected`` audit
record and an error in the log listing every problem.

Reloads happen when the file changes (device, inode, size or modification time differ, which
also catches the atomic symlink swap of a Kubernetes ConfigMap volume) and on request
(:meth:`ConfigStore.request_reload`, wired to SIGHUP by the daemon).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from nri_plugin.config.loader import ConfigError, load_file
from nri_plugin.config.schema import Config, in_force
from reconciler.aio import sleep_until
from reconciler.audit import AuditLog

DEFAULT_CONFIG_PATH = "/etc/nri-qos/config.toml"
EMBEDDED_DEFAULTS = "embedded defaults"

Subscriber = Callable[[Config, Config], None]

log = structlog.get_logger("nri_qos.config")


@dataclass(frozen=True, slots=True)
class FileStamp:
    device: int
    inode: int
    size: int
    mtime_ns: int


def file_stamp(path: Path) -> FileStamp | None:
    """What identifies one version of the file; None when it cannot be stat'ed (e.g. missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def load_config(path: str | None, *,
                default_path: str = DEFAULT_CONFIG_PATH) -> tuple[Config, str]:
    """The configuration and where it came from: the file at ``path``, or with ``path`` None the
    file at ``default_path`` if there is one, else the embedded defaults. Raises
    :class:`ConfigError` (a missing explicit ``path`` included)."""
    target = Path(path if path is not None else default_path)
    if path is None and not target.exists():
        return Config(), EMBEDDED_DEFAULTS
    cfg: Config = load_file(Config, target)
    return cfg, str(target)


class ConfigStore:
    """The current configuration, swapped atomically on a valid reload.

    ``clock`` (default: the running loop's ``time``) paces :meth:`watch`; subscribers are called
    as ``subscriber(old, new)`` after each swap, in subscription order, in the caller's thread.
    """

    def __init__(self, audit: AuditLog, *, config: Config | None = None,
                 clock: Callable[[], float] | None = None,
                 default_path: str = DEFAULT_CONFIG_PATH) -> None:
        self._audit = audit
        self._default_path = default_path
        self._current = config if config is not None else Config()
        self._in_force = in_force(self._current)
        self._clock = clock
        self._path: Path | None = None
        self._explicit = False
        self._stamp: FileStamp | None = None
        self._subscribers: list[Subscriber] = []
        self._reload_requested = asyncio.Event()

    @property
    def current(self) -> Config:
        return self._current

    @property
    def in_force(self) -> Config:
        """The current configuration as the actions run with it: in observe mode with every
        mitigation rung and the eviction manager held in dry-run (:func:`in_force`)."""
        return self._in_force

    @property
    def source(self) -> str:
        """The file the current configuration came from, or ``embedded defaults``."""
        if self._path is None or (not self._explicit and self._stamp is None):
            return EMBEDDED_DEFAULTS
        return str(self._path)

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber(old, new)`` after every swap; returns the unsubscribe function."""
        self._subscribers.append(subscriber)
        return lambda: self._subscribers.remove(subscriber)

    def load_initial(self, path: str | os.PathLike[str] | None) -> Config:
        """Load the configuration at startup.

        ``path`` None means the default path (:data:`DEFAULT_CONFIG_PATH`), where a missing file
        means the embedded defaults; a path given explicitly must exist. Raises
        :class:`ConfigError` (after auditing ``config_rejected``) when the file is invalid.
        """
        self._explicit = path is not None
        self._path = Path(path) if path is not None else Path(self._default_path)
        cfg = self._read()
        self._swap(cfg)
        return cfg

    def reload(self) -> bool:
        """Re-read the file now; True when a different configuration took effect."""
        try:
            cfg = self._read()
        except ConfigError as exc:
            log.error("config_rejected", path=str(self._path), errors=list(exc.errors),
                      hint="the previous configuration stays in force; "
                           "check the file with: nri-qos check-config PATH")
            return False
        return self._swap(cfg)

    def changed_on_disk(self) -> bool:
        return self._path is not None and file_stamp(self._path) != self._stamp

    def request_reload(self) -> None:
        """Ask :meth:`watch` to reload now (the SIGHUP path). Call from the loop's thread."""
        self._reload_requested.set()

    async def watch(self, stop: asyncio.Event, interval_s: float = 2.0) -> None:
        """Reload on request, and when the file changed, checked every ``interval_s``; returns
        when ``stop`` is set."""
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        clock = self._clock or asyncio.get_running_loop().time
        next_check = clock() + interval_s
        while not stop.is_set():
            await sleep_until(max(0.0, next_check - clock()), stop, self._reload_requested)
            if stop.is_set():
                return
            if self._reload_requested.is_set():
                self._reload_requested.clear()
                self.reload()
            # A request does not reset the polling cadence.
            if clock() >= next_check:
                next_check = clock() + interval_s
                if self.changed_on_disk():
                    self.reload()


    def _read(self) -> Config:
        """Read and check the file; a rejected one is audited (``config_rejected``) and raised."""
        if self._path is None:
            raise RuntimeError("load_initial() must run first")
        # Stamp first: a change made while reading is then seen by the next check.
        self._stamp = file_stamp(self._path)
        try:
            cfg, _ = load_config(str(self._path) if self._explicit else None,
                                 default_path=str(self._path))
        except ConfigError as exc:
            self._audit.record("config_rejected", source=str(self._path),
                               errors=list(exc.errors))
            raise
        return cfg

    def _swap(self, cfg: Config) -> bool:
        old, changed = self._current, cfg != self._current
        if changed:
            self._current, self._in_force = cfg, in_force(cfg)
            for subscriber in list(self._subscribers):
                try:
                    subscriber(old, cfg)
                except Exception:
                    log.exception("config_subscriber_failed", subscriber=_name(subscriber))
        # After the subscribers, so a newly configured audit file receives this record.
        self._audit.record("config_loaded", source=self.source, changed=changed)
        return changed


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or repr(obj)
