"""The runtime folder (router.runtime_dir): the ipc:// socket and the shared weights' file live here.

Whoever can write into it could put a socket of their own where the workers connect, or a file
of CUDA IPC handles where a decode reads its weights. systemd's RuntimeDirectory= is made right,
but the fallback /tmp/pdserve-<uid> sits in a folder every user can write: another user may have
made it first, or left it open. So every service checks the folder at start, and files are
created in it without following a symlink planted in their place.

One router holds the folder at a time (claim_runtime_dir): a second one, of a second stack started
on the same folder, would bind over the first's socket (ZeroMQ replaces a socket file it binds
over) and draw the first's workers to it.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

from shared.control.dispatch import FatalError
from shared.control.messages import EXIT_REFUSED

CLAIM_FILE = "router.lock"


class UnsafePath(ValueError):
    pass


class FolderInUse(FatalError):
    """A restart would find the folder held again: exits EXIT_REFUSED, which nothing restarts."""
    exit_code = EXIT_REFUSED


def claim_runtime_dir(path: str) -> BinaryIO:
    """Holds the folder for this router until the returned file is closed or the process ends,
    however it ends (an flock, which the kernel drops with the process); the file names the
    holder's pid. FolderInUse while another process holds it."""
    claim = Path(path) / CLAIM_FILE
    file = os.fdopen(os.open(claim, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "r+b")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = file.read().decode(errors="replace").strip() or "unknown"
        file.close()
        raise FolderInUse(f"runtime folder {path} is held by another router (pid {holder}), of another stack "
                          "on this host: stop that stack, or give this one a folder of its own "
                          "(router.runtime_dir)") from None
    file.truncate(0)
    file.write(str(os.getpid()).encode())
    file.flush()
    return file


def prepare_runtime_dir(path: str) -> None:
    """Creates the folder with mode 0700 if missing; refuses one that is a symlink, that this user
    does not own, or that its group or others may write into."""
    folder = Path(path)
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode):  # lstat: a symlink, even to a good folder, is refused too
        raise UnsafePath(f"runtime folder {folder} is a symlink or a file, not a folder: remove it, "
                         "or set router.runtime_dir")
    if info.st_uid != os.getuid():
        raise UnsafePath(f"runtime folder {folder} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}): "
                         "remove it, or set router.runtime_dir to a folder of this user's")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePath(f"runtime folder {folder} has mode {stat.S_IMODE(info.st_mode):04o}, writable by its group "
                         f"or others: `chmod 700 {folder}`")


def write_private_file(path: Path, data: bytes) -> None:
    """Writes path whole (a reader sees all of it or none), mode 0600, through no symlink: one at
    path, or at the staging name beside it, is refused."""
    staging = path.with_name(f"{path.name}.tmp")
    for target in (path, staging):
        if target.is_symlink():
            raise UnsafePath(f"{target} is a symlink: refusing to write through it; remove it")
    staging.unlink(missing_ok=True)  # left by a run that died mid-write
    # O_EXCL|O_NOFOLLOW: a symlink planted after the check above still makes the open fail.
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.replace(staging, path)  # rename(2) replaces whatever is at path, never what it points to
