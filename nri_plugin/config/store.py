"""The configuration in force, and its reloads.

:class:`ConfigStore` holds the current :class:`Config`. Components read ``store.current`` when
they need it (the object is frozen, so one event sees one consistent configuration), or subscribe
to hear about a new one. A reload validates the whole file first and swaps only a valid
configuration: an invalid file leaves the running one in force, with a ``config_rejected`` audit
record and an error in the log listing every problem. The keys the agent reads at start only
(:mod:`nri_plugin.config.start_only`) keep their value at start in the configuration in force; a
reload that changes one is said in a ``config_restart_needed`` audit record, and the rest of it
applies.

The configuration is the main file and its drop-ins, ``<main>.d/*.toml`` applied over it in
lexical order (as containerd's, systemd's and the kubelet's drop-ins are): an overlay or an
operator changes a few keys in a file of its own instead of copying the whole configuration.

Reloads happen when a file changes (device, inode, size or modification time differ, which also
catches the atomic symlink swap of a Kubernetes ConfigMap volume), when a drop-in comes or goes,
and on request (:meth:`ConfigStore.request_reload`, wired to SIGHUP by the daemon).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from common.aio import sleep_until
from common.audit import AuditLog
from nri_plugin.config.loader import ConfigError, Layered, drop_in_dir, drop_ins, load_layers
from nri_plugin.config.schema import Config, in_force
from nri_plugin.config.start_only import hold_start_values, restart_needed, value_at

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


Stamp = tuple[FileStamp | None, tuple[tuple[str, FileStamp | None], ...]]
"""What identifies one version of a configuration: its main file and each drop-in."""


def config_stamp(main: Path) -> Stamp:
    try:
        dropped = drop_ins(main)
    except ConfigError:
        dropped = []
    return file_stamp(main), tuple((p.name, file_stamp(p)) for p in dropped)


def load_layered(path: str | None, *, default_path: str = DEFAULT_CONFIG_PATH) -> Layered:
    """The configuration of the file at ``path`` (which must exist) or, with ``path`` None, at
    ``default_path`` (the embedded defaults when it does not exist), with the drop-ins beside
    it. Raises :class:`ConfigError`."""
    main = Path(path if path is not None else default_path)
    files = drop_ins(main)
    if path is not None or main.exists():
        files.insert(0, main)
    return load_layers(Config, files)


def load_config(path: str | None, *,
                default_path: str = DEFAULT_CONFIG_PATH) -> tuple[Config, str]:
    """The configuration and where it came from (:func:`load_layered`): the files read, or
    the embedded defaults. Raises :class:`ConfigError`."""
    layered = load_layered(path, default_path=default_path)
    return layered.config, sources_text(layered.files)


def sources_text(files: tuple[str, ...]) -> str:
    return ", ".join(files) if files else EMBEDDED_DEFAULTS


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
        # The configuration the agent started with (its start-only keys stay in force), and the
        # one the files said last.
        self._start = self._files = self._current
        self._restart_needed: Mapping[str, tuple[Any, Any]] = {}
        self._refused: tuple[str, ...] = ()
        self._clock = clock
        self._path: Path | None = None
        self._explicit = False
        self._stamp: Stamp | None = None
        self._source = EMBEDDED_DEFAULTS
        self._subscribers: list[Subscriber] = []
        self._load_listeners: list[Callable[[bool], None]] = []
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
    def refused(self) -> tuple[str, ...]:
        """The errors of the files' latest version when it was refused (an older configuration
        in force); empty once a load takes effect. A refused version is read once, so nothing
        else keeps saying it."""
        return self._refused

    @property
    def restart_needed(self) -> Mapping[str, tuple[Any, Any]]:
        """The start-only keys the files set to another value than the one in force: key ->
        (value in force, value in the files); they take effect at the next start."""
        return self._restart_needed

    @property
    def source(self) -> str:
        """The files the current configuration came from, or ``embedded defaults``."""
        return self._source

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber(old, new)`` after every swap; returns the unsubscribe function."""
        self._subscribers.append(subscriber)
        return lambda: self._subscribers.remove(subscriber)

    def on_load(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(took_effect)`` after every later load: True when a configuration was
        read and is in force (changed or not), False when it was refused."""
        self._load_listeners.append(listener)

    def load_initial(self, path: str | os.PathLike[str] | None) -> Config:
        """Load the configuration at startup.

        ``path`` None means the default path (:data:`DEFAULT_CONFIG_PATH`), where a missing file
        means the embedded defaults; a path given explicitly must exist. Raises
        :class:`ConfigError` (after auditing ``config_rejected``) when the file is invalid.
        """
        self._explicit = path is not None
        self._path = Path(path) if path is not None else Path(self._default_path)
        cfg, source = self._read(hint="no configuration is in force yet: the command stops; check "
                                      "the files with: nri-qos check-config PATH")
        self._start = cfg
        self._swap(cfg, source)
        return self._current

    def reload(self) -> bool:
        """Re-read the file now; True when a different configuration took effect."""
        try:
            cfg, source = self._read()
        except ConfigError as exc:
            # Said by the config_rejected record.
            self._refused = tuple(exc.lines())
            self._loaded(False)
            return False
        changed = self._swap(cfg, source)
        self._refused = ()
        self._loaded(True)
        return changed

    def _loaded(self, ok: bool) -> None:
        for listener in self._load_listeners:
            listener(ok)

    def changed_on_disk(self) -> bool:
        return self._path is not None and config_stamp(self._path) != self._stamp

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


    def _read(self, hint: str = "the previous configuration stays in force; check the files "
                                "with: nri-qos check-config PATH") -> tuple[Config, str]:
        """Read and check the file; a rejected one is audited (``config_rejected``, with
        ``hint``) and raised."""
        if self._path is None:
            raise RuntimeError("load_initial() must run first")
        # Stamp first: a change made while reading is then seen by the next check.
        self._stamp = config_stamp(self._path)
        try:
            layered = load_layered(str(self._path) if self._explicit else None,
                                   default_path=str(self._path))
        except ConfigError as exc:
            self._audit.record("config_rejected", source=str(self._path),
                               drop_ins=str(drop_in_dir(self._path)), errors=exc.lines(),
                               hint=hint)
            raise
        cfg: Config = layered.config
        return cfg, sources_text(layered.files)

    def _swap(self, files: Config, source: str) -> bool:
        previous, self._files = self._files, files
        cfg = hold_start_values(self._start, files)
        old, changed = self._current, cfg != self._current
        self._source = source
        if changed:
            self._current, self._in_force = cfg, in_force(cfg)
            for subscriber in list(self._subscribers):
                try:
                    subscriber(old, cfg)
                except Exception:
                    log.exception("config_subscriber_failed", subscriber=_name(subscriber))
        # After the subscribers, so a newly configured audit file receives this record.
        self._audit.record("config_loaded", source=self.source, changed=changed)
        self._restart_needed = restart_needed(self._start, files)
        # Said when the files change such a key, not again at every later reload.
        said = {key: {"in_force": held, "new": new}
                for key, (held, new) in self._restart_needed.items()
                if value_at(previous, key) != new}
        if said:
            self._audit.record("config_restart_needed", source=self.source, keys=said,
                               hint="these keys are read at start only: their value in force "
                                    "stays until the agent restarts; the rest of the "
                                    "configuration applies")
        return changed


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or repr(obj)
