"""One save at a time per checkpoint directory (``docs/checkpoint-io.md``, "Saving:
the atomic commit protocol", step 0).

Two saves racing to one path (threads, processes, ranks that each save a non-collective
store) would each remove the other's shards as "stale" once their own manifest is in place,
and both report success over a manifest naming deleted shards. A save therefore holds
``<path>/.statestore-save.lock``, exclusively ``flock``\\ ed, from before it writes anything
until its clean-up is done; a second save finds it held and fails at once with
``StateStoreIOError(EBUSY)``, having written nothing, so the path ends up holding the
winner's complete checkpoint (or the previous one). The kernel releases the lock when its
holder dies, however it dies; a lock file left by a killed save is taken over by the next one
and removed at its end.

flock works between processes on one machine and, on most network filesystems, between
machines; where the path is not local (fsspec URLs) there is no lock: the save verifies after
its commit that the manifest in place is its own and otherwise fails without removing
anything (object stores give no stronger primitive).
"""
from __future__ import annotations

import errno
import fcntl
import os
from typing import Optional

from ..errors import StateStoreIOError

__all__ = ["SAVE_LOCK", "SaveLock"]

SAVE_LOCK = ".statestore-save.lock"


class SaveLock:
    """The save lock of the local checkpoint directory ``root`` (``path``: the user's name
    for it, used in messages). :meth:`release` removes it."""

    def __init__(self, root: str, path: str):
        self.path = os.path.join(root, SAVE_LOCK)
        self.fd: Optional[int] = None
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        while True:
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as e:
                raise StateStoreIOError(e.errno, f"saving checkpoint {path!r}: cannot create its "
                                        f"lock file {self.path}: {e.strerror}", self.path) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise StateStoreIOError(
                        errno.EBUSY, f"saving checkpoint {path!r}: another save to it is in "
                        f"progress (it holds {self.path}); this save wrote nothing, and the "
                        f"checkpoint there will be that save's (or the previous one)",
                        self.path) from None
                raise StateStoreIOError(e.errno, f"saving checkpoint {path!r}: cannot lock "
                                        f"{self.path}: {e.strerror}", self.path) from e
            try:    # still the file at that name? (its holder may have removed it meanwhile)
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except OSError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.unlink(self.path)    # while still locked: a waiter then sees another inode
        except OSError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> "SaveLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
