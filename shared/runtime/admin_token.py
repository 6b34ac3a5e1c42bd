"""The admin token of a stack on one machine: what `make run` gives the router's Admin service
when router.admin_token_file is unset, and where `pdserve drain` looks for it by default.

It is the file admin-token in the runtime folder, which every service checks to be this user's
alone (0700, runtime_dir.py), written mode 0600 through no symlink: only the user who runs the
stack can drain its workers. A token already there is kept, so a second launcher (or a restart)
never locks `pdserve drain` out of a stack that still runs with the first one's token.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from shared.runtime.runtime_dir import write_private_file

FILE_NAME = "admin-token"


def local_admin_token_path(runtime_dir: str) -> Path:
    return Path(runtime_dir) / FILE_NAME


def ensure_local_admin_token(runtime_dir: str) -> Path:
    """The runtime folder's admin token file: kept when it is this user's private, non-empty file,
    else written afresh with a random token."""
    path = local_admin_token_path(runtime_dir)
    if not _private_token(path):
        write_private_file(path, secrets.token_urlsafe(32).encode() + b"\n")
    return path


def _private_token(path: Path) -> bool:
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    private = stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
    return private and bool(path.read_text().strip())
