"""Files for the I/O engines: O_DIRECT where the filesystem supports it, probed by opening.

:class:`IOFile` opens a file with ``O_DIRECT`` when ``direct`` is ``None`` (probe) or ``True``
(required). Where the filesystem refuses ``O_DIRECT`` (``EINVAL`` at open), a probing open falls
back to buffered I/O and warns once per process; the engines then write back and drop the page
cache for every range they transfer (``sync_file_range`` + ``posix_fadvise(DONTNEED)``), so the
page cache does not quietly hold the states.

Direct files need 4096-aligned buffer addresses, offsets and sizes; the engines check that and
name the offending argument.
"""
from __future__ import annotations

import errno
import os
import threading
import warnings

from statestore.errors import StateStoreIOError, StateStoreValueError

__all__ = ["IOFile", "DIRECT_ALIGNMENT", "drop_page_cache", "reserve_space"]

DIRECT_ALIGNMENT = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_warned_lock = threading.Lock()
_warned = False


def _warn_buffered_once(path: str, reason: str) -> None:
    global _warned
    with _warned_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(f"statestore: O_DIRECT is not supported for '{path}' ({reason}); using buffered "
                  "I/O and dropping the page cache after each transfer", RuntimeWarning, stacklevel=3)


def drop_page_cache(fd: int, offset: int = 0, length: int = 0, *, path: str = "") -> None:
    """Writes back dirty pages of the range, then asks the kernel to drop its cached pages
    (``length=0``: to the end of the file). Raises :class:`StateStoreIOError` naming ``path``."""
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        raise StateStoreIOError(e.errno, f"dropping the page cache of '{path}' failed: {e.strerror}",
                                path) from e


def reserve_space(fd: int, offset: int, length: int) -> bool:
    """``posix_fallocate`` of ``[offset, offset + length)``: the space is the file's now, so a
    full disk shows up here rather than in a later write (or, for a mapping, as SIGBUS).
    Returns False where the filesystem cannot reserve space (the caller extends the file
    some other way); other failures (ENOSPC, EFBIG, ...) raise ``OSError``."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise
    return True


class IOFile:
    """An open file for :class:`~statestore.io.IOEngine` requests.

    ``create=True`` creates the file when absent (never truncates). ``direct``: ``None`` probes
    ``O_DIRECT`` and falls back to buffered I/O with one warning; ``True`` requires it; ``False``
    opens buffered. ``drop_cache`` (default: ``not self.direct``) makes the engines write back and
    evict the page cache of every range they transfer.
    """

    def __init__(self, path: str | os.PathLike, *, create: bool = False, readonly: bool = False,
                 direct: bool | None = None, drop_cache: bool | None = None) -> None:
        self.path = os.fspath(path)
        if create and readonly:
            raise StateStoreValueError("create and readonly are mutually exclusive")
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | getattr(os, "O_CLOEXEC", 0)
        if create:
            flags |= os.O_CREAT
        self.fd = -1
        self.direct = False
        if direct is not False and _O_DIRECT:
            try:
                self.fd = os.open(self.path, flags | _O_DIRECT, 0o644)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL or direct is True:
                    raise StateStoreIOError(e.errno, f"cannot open '{self.path}' for direct I/O: "
                                            f"{e.strerror}", self.path) from e
                _warn_buffered_once(self.path, e.strerror or "EINVAL")
        elif direct is True:
            raise StateStoreIOError(errno.ENOTSUP, "O_DIRECT is not available on this platform",
                                    self.path)
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, flags, 0o644)
            except OSError as e:
                raise StateStoreIOError(e.errno, f"cannot open '{self.path}': {e.strerror}",
                                        self.path) from e
        self.drop_cache = (not self.direct) if drop_cache is None else bool(drop_cache)
        if self.drop_cache and not self.direct:
            # No kernel read-ahead: it would fill the cache beyond the ranges we drop.
            try:
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
            except OSError:
                pass  # advisory only; the ranges transferred are still dropped
        self.alignment = DIRECT_ALIGNMENT if self.direct else 1
        self._allocated = -1      # bytes known to lie within the file (reserved), -1: unknown

    # --- file-level operations (synchronous) -------------------------------------------------
    def size(self) -> int:
        self._check_open()
        try:
            return os.fstat(self.fd).st_size
        except OSError as e:
            raise StateStoreIOError(e.errno, f"fstat of '{self.path}' failed: {e.strerror}",
                                    self.path) from e

    def truncate(self, nbytes: int) -> None:
        self._check_open()
        try:
            os.ftruncate(self.fd, nbytes)
        except OSError as e:
            raise StateStoreIOError(e.errno, f"resizing '{self.path}' to {nbytes} bytes failed: "
                                    f"{e.strerror}", self.path) from e

    def allocate(self, nbytes: int) -> None:
        """Reserves ``nbytes`` of disk space (``posix_fallocate``), so ENOSPC shows up now
        rather than in the middle of a later write."""
        self._check_open()
        try:
            reserved = reserve_space(self.fd, 0, nbytes)
        except OSError as e:
            raise StateStoreIOError(e.errno, f"reserving {nbytes} bytes for '{self.path}' failed: "
                                    f"{e.strerror}", self.path) from e
        if not reserved:
            self.truncate(max(nbytes, self.size()))

    def ensure_allocated(self, end: int) -> None:
        """Makes sure bytes ``[0, end)`` lie within the file, reserving the missing tail with
        ``posix_fallocate``. The engines call it before direct writes: on ext4/xfs an O_DIRECT
        write that extends the file runs synchronously (one request at a time), while writes
        inside the file's size proceed in parallel at the queue's depth."""
        if end <= self._allocated:
            return
        size = self.size()
        if end > size:
            try:
                reserved = reserve_space(self.fd, size, end - size)
            except OSError as e:
                raise StateStoreIOError(e.errno, f"reserving {end - size} bytes at the end of "
                                        f"'{self.path}' failed: {e.strerror}", self.path) from e
            if not reserved:
                return   # no fallocate here: extending writes stay correct, only slower
            size = end
        self._allocated = size

    def fsync(self) -> None:
        """Makes the data written so far durable: ``fdatasync``, which flushes the data and
        the metadata needed to read it back (extents, size), not the timestamps a plain
        ``fsync`` would also commit to the journal after every direct write."""
        self._check_open()
        try:
            os.fdatasync(self.fd)
        except OSError as e:
            raise StateStoreIOError(e.errno, f"fsync of '{self.path}' failed: {e.strerror}",
                                    self.path) from e

    def drop_cache_now(self) -> None:
        """Drops this file's pages from the page cache (a no-op for data read with O_DIRECT)."""
        self._check_open()
        drop_page_cache(self.fd, path=self.path)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                os.close(fd)
            except OSError as e:
                raise StateStoreIOError(e.errno, f"closing '{self.path}' failed: {e.strerror}",
                                        self.path) from e

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def _check_open(self) -> None:
        if self.fd < 0:
            raise StateStoreIOError(errno.EBADF, f"'{self.path}' is closed", self.path)

    def __enter__(self) -> "IOFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return f"IOFile({self.path!r}, direct={self.direct}, fd={self.fd})"
