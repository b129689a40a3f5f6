"""Replacing a file so that a crash leaves either the old or the new content, never a torn file.

The one way every layer replaces a file (boot state, node parameters, keyrings, key files, images,
the fleet's image index): write a temp file in the target's directory, fsync it, rename it over the
target, fsync the directory (the rename is only durable once the directory entry is on disk).
A failure before the rename (an exception, a full disk, a SIGKILL) leaves the target untouched; the
temp file of a failed write is removed (one of a killed process is left as ``.NAME.*.tmp``, never
under the target's name). Lives in the shared base so compiler, federation, firmware, edgenode and
api all use it; imports nothing of the project.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_open", "atomic_write", "fsync_dir", "replace_durably"]


def fsync_dir(path: str | Path) -> None:
    """fsync a directory (a rename or a new file is only durable once its directory entry is on disk)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(
    path: str | Path, *, mode: int | None = None, before_rename: Callable[[], None] | None = None
) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; it replaces ``path`` when the block ends
    without an exception (fsync, rename, fsync the directory), else ``path`` keeps its old content.

    ``mode``: the new file's permission bits (e.g. ``0o600`` for a private key; the temp file has
    them from its creation, so the secret is never readable by others); by default 0o666 minus the
    umask, as ``open`` gives. ``before_rename`` runs after the data is durable and before the rename
    (the seam the flash fault tests kill the process at)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(
    path: str | Path, data: bytes | str, *, mode: int | None = None,
    before_rename: Callable[[], None] | None = None,
) -> None:
    """Replace ``path``'s content with ``data`` (str is written as UTF-8): old or new, never torn."""
    with atomic_open(path, mode=mode, before_rename=before_rename) as fh:
        fh.write(data.encode() if isinstance(data, str) else data)


def replace_durably(src: str | Path, dst: str | Path) -> None:
    """Rename a file that is already complete and fsynced (a staged download, prepared parameters)
    over ``dst`` and make the rename durable (fsync the directory; both, if they differ)."""
    src, dst = Path(src), Path(dst)
    os.replace(src, dst)
    fsync_dir(dst.parent)
    if src.parent.resolve() != dst.parent.resolve():
        fsync_dir(src.parent)
