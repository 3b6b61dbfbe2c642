"""The check every OCI hook executable named in the configuration must pass.

An injected hook runs as root inside every matching container, so only files that nobody but root
can change qualify. That takes more than the file's own owner and mode: whoever can write to a
directory on the way (or replace a symbolic link the path goes through) can put another file in
its place after the check. The path is therefore resolved one component at a time, as the kernel
does, and everything it passes through is checked:

* every directory traversed is owned by root and not group- or world-writable, unless it is
  sticky (like ``/tmp``: there only an entry's owner may replace it, and every entry the path
  uses must be root's);
* every symbolic link is owned by root, and a chain of them ends within the kernel's own limit;
* the file at the end is a regular file, executable, owned by root and writable by root alone.

The policies that name hook paths do no I/O; the configuration checks the files when it is
loaded (and at every reload).
"""

from __future__ import annotations

import os
import stat

MAX_SYMLINKS = 40
"""Symbolic links followed in one path at most, as the kernel's MAXSYMLINKS."""


class _Untrusted(Exception):
    """Why the path may not be used; the message names the component at fault."""


def check_hook_path(path: str) -> str | None:
    """Why ``path`` may not be used as a hook executable, or None when it may."""
    if not os.path.isabs(path):
        return f"must be an absolute path, got {path!r}"
    if "\0" in path:
        return f"must not contain a NUL character, got {path!r}"
    try:
        resolved, st = _walk(path)
    except _Untrusted as exc:
        return f"{path}: {exc}"
    shown = path if resolved == path else f"{path} (-> {resolved})"
    if not stat.S_ISREG(st.st_mode):
        return f"{shown}: not a regular file"
    if not st.st_mode & 0o111:
        return f"{shown}: not executable"
    if st.st_uid != 0:
        return f"{shown}: must be owned by root (uid 0), owner is uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"{shown}: must not be group- or world-writable (mode {stat.filemode(st.st_mode)})"
    return None


def _walk(path: str) -> tuple[str, os.stat_result]:
    """The path resolved (symbolic links followed) and the stat of what it names, after checking
    every directory and link on the way; raises :class:`_Untrusted`."""
    pending = _components(path)
    pending.reverse()  # a stack: the next component last
    current = "/"
    st = os.lstat(current)
    _check_dir(current, st)
    links = 0
    while pending:
        name = pending.pop()
        if name == "..":
            # The parent was traversed (and checked) on the way down.
            current = os.path.dirname(current)
            st = os.lstat(current)
            continue
        candidate = os.path.join(current, name)
        try:
            st = os.lstat(candidate)
            target = os.readlink(candidate) if stat.S_ISLNK(st.st_mode) else ""
        except OSError as exc:
            raise _Untrusted(f"{candidate}: {exc.strerror}" if candidate != path
                             else str(exc.strerror)) from exc
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_SYMLINKS:
                raise _Untrusted("too many levels of symbolic links")
            if st.st_uid != 0:
                raise _Untrusted(f"symbolic link {candidate} must be owned by root (uid 0), "
                                 f"owner is uid {st.st_uid}")
            if target.startswith("/"):
                current = "/"
            pending.extend(reversed(_components(target)))
            st = os.lstat(current)
            continue
        if pending:
            if not stat.S_ISDIR(st.st_mode):
                raise _Untrusted(f"{candidate}: not a directory")
            _check_dir(candidate, st)
        current = candidate
    return current, st


def _check_dir(directory: str, st: os.stat_result) -> None:
    if st.st_uid != 0:
        raise _Untrusted(f"directory {directory} must be owned by root (uid 0), owner is uid "
                         f"{st.st_uid}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise _Untrusted(f"directory {directory} must not be group- or world-writable unless "
                         f"sticky (mode {stat.filemode(st.st_mode)})")


def _components(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]
