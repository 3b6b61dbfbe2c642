"""The check every OCI hook executable named in the configuration must pass.

An injected hook runs as root inside every matching container, so only trusted files qualify. The
policies that name hook paths do no I/O; the configuration checks the files when it is loaded.
"""

from __future__ import annotations

import os
import stat


def check_hook_path(path: str) -> str | None:
    """Why ``path`` may not be used as a hook executable, or None when it may."""
    if not os.path.isabs(path):
        return f"must be an absolute path, got {path!r}"
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path}: not a regular file"
    if not st.st_mode & 0o111:
        return f"{path}: not executable"
    if st.st_uid != 0:
        return f"{path}: must be owned by root (uid 0), owner is uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"{path}: must not be group- or world-writable (mode {stat.filemode(st.st_mode)})"
    return None
