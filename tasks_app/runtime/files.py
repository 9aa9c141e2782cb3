"""Private files in the data folder: owner-only from the first byte.

The data folder holds the SQLite database (sessions, password hashes, encrypted agent
credentials), the generated secret key, the first admin password, beat's schedule and the
private Redis's working folder. A file written with
the default umask and ``chmod``-ed afterwards is readable by anyone for a moment (and for
good if the process dies in between), so files are *created* with mode 0600 by
``os.open`` and the folder is created 0700. Files made by code that is not ours (beat's
dbm schedule, Redis) are made under ``PRIVATE_UMASK`` instead. This module imports nothing from Django: the
settings module uses it before Django is set up.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700
# For processes whose every file is ours alone (beat's schedule, the private Redis): whatever
# they create, however they create it, starts owner-only.
PRIVATE_UMASK = 0o077


def private_dir(path: Path) -> None:
    """Create ``path`` (owner-only) if it is missing; an existing folder is left as it is."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, a file only its owner can read, before any byte lands.

    An existing file is truncated and narrowed (``fchmod`` on the open descriptor) before
    the new content is written, so an older file with a wider mode never holds it.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "w") as handle:
            fd = -1
            handle.write(text)
    finally:
        if fd >= 0:
            os.close(fd)


def create_private_once(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text`` unless it exists; never visible half-written.

    The content goes to a private temporary file first, which is then linked to its
    name (``link`` fails when the name exists): two processes starting at once agree on
    one value. Returns whether this call created it.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    write_private(tmp, text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def ensure_private_file(path: Path) -> None:
    """An empty owner-only file at ``path`` if none exists (SQLite takes an empty file as a
    new database, and gives its WAL and shared-memory files the database file's mode).

    A file left by an older version with a wider mode is narrowed, with its WAL and
    shared-memory companions.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        for existing in (path, Path(f"{path}-wal"), Path(f"{path}-shm"), Path(f"{path}-journal")):
            narrow(existing)
    else:
        os.close(fd)


def private_work_dir(path: Path) -> Path:
    """``path`` as a folder only its owner can enter: created 0700, or narrowed if an older
    version left it wider. For folders wholly ours (the private Redis's working folder)."""
    private_dir(path)
    try:
        info = path.stat()
        if info.st_uid == os.geteuid() and info.st_mode & 0o077:
            path.chmod(DIR_MODE)
    except OSError:
        pass
    return path


def narrow_family(path: Path) -> None:
    """Narrow ``path`` and its companions (``path.db``, ``path-wal``, ``path.dat`` ...): the
    files a store named ``path`` may have made, whichever dbm or SQLite backend made them."""
    try:
        siblings = list(path.parent.iterdir())
    except OSError:
        return
    for sibling in siblings:
        if sibling.name.startswith(path.name) and sibling.is_file():
            narrow(sibling)


def narrow(path: Path) -> None:
    """Make an existing file of ours owner-only; anything else (missing, not ours) is left."""
    try:
        info = path.stat()
        if info.st_uid == os.geteuid() and info.st_mode & 0o077:
            path.chmod(info.st_mode & 0o700)
    except OSError:
        pass
