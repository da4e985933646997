"""Disk space checked before anything is written (``docs/reliability.md``, "Disk space").

A store whose filesystem cannot hold its states (or what copy-on-write will need after a
linked checkpoint) must say so *before* a step or a save touches anything, with the bytes
needed and the bytes free, instead of failing with ENOSPC half-way. The check here is the
up-front estimate (``statvfs``); the reservation itself (``posix_fallocate`` of every file)
stays authoritative, and its ENOSPC gets the same message.
"""
from __future__ import annotations

import errno
import os
from typing import Optional

from ..errors import StateStoreIOError

__all__ = ["free_bytes", "no_space", "check_space", "reclaimable_bytes"]


def free_bytes(path: str) -> Optional[int]:
    """Bytes that may still be allocated on the filesystem of ``path`` (or of its directory,
    when ``path`` is a file that does not exist); None where ``statvfs`` fails. Counted as
    for an unprivileged user (``f_bavail``): blocks a filesystem keeps back (ext4's root
    reserve, and the clusters it reserves for itself, which ``f_bfree`` still counts) are
    not promised, so the check never passes where the reservation then fails."""
    for p in (path, os.path.dirname(path)):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def no_space(what: str, path: str, needed: int, free: Optional[int] = None,
             code: int = errno.ENOSPC, extra: str = "") -> StateStoreIOError:
    """The error of a reservation that does not fit: names ``what``, the file or directory
    ``path``, the bytes needed and the bytes free."""
    if free is None:
        free = free_bytes(path)
    have = "unknown" if free is None else f"{free} bytes ({_human(free)})"
    return StateStoreIOError(
        code, f"{what}: needs {needed} bytes ({_human(needed)}) on the filesystem of {path}, "
        f"which has {have} free{extra}; {os.strerror(code)}. Nothing was changed: free space "
        f"and retry", path)


def check_space(what: str, path: str, needed: int, extra_free: int = 0) -> None:
    """Raise :func:`no_space` when ``needed`` bytes exceed what is free on the filesystem of
    ``path`` (plus ``extra_free`` bytes the operation itself will free first)."""
    if needed <= 0:
        return
    free = free_bytes(path)
    if free is None or needed <= free + extra_free:
        return
    extra = f" (and {extra_free} bytes it frees itself)" if extra_free else ""
    raise no_space(what, path, needed, free, extra=extra)


def reclaimable_bytes(root: str, keep_prefix: str = "") -> int:
    """Bytes a checkpoint save into ``root`` frees once committed: the shards and temporaries
    of earlier saves there (``checkpoint.writer.remove_stale`` removes them) that no other name
    links (a shard still linked by a store or another checkpoint frees nothing)."""
    total = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        if keep_prefix and name.startswith(keep_prefix):
            continue
        if not (name.startswith("shard-") or name.startswith(".shard-")):
            continue
        try:
            st = os.lstat(os.path.join(root, name))
        except OSError:
            continue
        if st.st_nlink == 1 and not os.path.islink(os.path.join(root, name)):
            total += st.st_blocks * 512
    return total
