"""A sequential ``O_DIRECT`` file writer overlapped with its caller (checkpoint shards).

See :class:`DirectWriter`; ``docs/checkpoint-io.md`` ("Local writes") for its place in a save.
"""
from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from typing import Optional, Tuple

from ..errors import StateStoreIOError

__all__ = ["DirectWriter", "WRITE_BUFFERS", "WRITE_BUFFER_BYTES"]

_DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
WRITE_BUFFERS = 4
WRITE_BUFFER_BYTES = 8 * 1024 * 1024


class DirectWriter:
    """Sequential writer of one local shard with ``O_DIRECT``, overlapped with the caller.

    The caller's bytes are copied into one of :data:`WRITE_BUFFERS` page-aligned staging
    buffers of :data:`WRITE_BUFFER_BYTES` (32 MiB in all: the save's RAM on top of the
    store's pipeline budget); a full buffer goes to a writer thread, which ``pwrite``s it
    (the GIL is released) while the caller hashes and copies the next. Direct I/O bypasses
    the page cache: the shard is not read back into RAM and the final ``fsync`` has nothing
    to flush but metadata. :meth:`flush` writes the last, partial buffer padded to 4096
    bytes and truncates the file to its exact size. Where the filesystem refuses
    ``O_DIRECT`` (tmpfs), the same code writes through the page cache.
    """

    def __init__(self, path: str):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self._direct = bool(_O_DIRECT)
        try:
            self._fd = os.open(path, flags | _O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o644)
            self._direct = False
        self.path = path
        self._bufs = [mmap.mmap(-1, WRITE_BUFFER_BYTES) for _ in range(WRITE_BUFFERS)]
        self._free: "queue.Queue[int]" = queue.Queue()
        for i in range(WRITE_BUFFERS):
            self._free.put(i)
        self._work: "queue.Queue[Optional[Tuple[int, int, int]]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._pos = 0                 # bytes accepted
        self._cur: Optional[int] = None
        self._fill = 0
        self._file_off = 0            # offset of the current buffer in the file
        self._finished = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="statestore-ckpt-writer",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            i, n, off = item
            try:
                if self._error is None:
                    self._write_buffer(i, n, off)
            except BaseException as e:      # reported to the caller at its next call
                # Without its traceback: the frames would keep views of the buffer exported,
                # and closing the buffers would then fail, masking this error.
                self._error = e.with_traceback(None)
            finally:
                self._free.put(i)

    def _write_buffer(self, i: int, n: int, off: int) -> None:
        with memoryview(self._bufs[i]) as view:
            done = 0
            while done < n:
                with view[done:n] as chunk:
                    try:
                        w = os.pwrite(self._fd, chunk, off + done)
                    except OSError as e:
                        if e.errno != errno.EINVAL or not self._direct:
                            raise
                        # O_DIRECT refused the transfer: a limit (RLIMIT_FSIZE, a quota) cut it
                        # to an unaligned size, or the filesystem changed its mind. Go on through
                        # the page cache, where the real cause (EFBIG, ENOSPC) is reported.
                        self._go_buffered()
                        continue
                if w <= 0:
                    raise OSError(errno.EIO, f"short write to {self.path}")
                done += w

    def _go_buffered(self) -> None:
        import fcntl
        fl = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fl & ~_O_DIRECT)
        self._direct = False

    def _check(self) -> None:
        if self._error is not None:
            e = self._error
            if isinstance(e, OSError):
                raise StateStoreIOError(e.errno, f"writing {self.path} failed: {e}") from e
            raise e

    def _submit(self, nbytes: int) -> None:
        self._work.put((self._cur, nbytes, self._file_off))
        self._file_off += nbytes
        self._cur, self._fill = None, 0

    def write(self, data) -> int:
        """Accept ``data`` (any buffer) at the end of the file; returns its length.

        Raises:
            StateStoreIOError: an earlier buffer's write failed (names the file).
        """
        self._check()
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            if self._cur is None:
                self._cur = self._free.get()
                self._check()
            n = min(len(mv) - done, WRITE_BUFFER_BYTES - self._fill)
            self._bufs[self._cur][self._fill:self._fill + n] = mv[done:done + n]
            self._fill += n
            done += n
            if self._fill == WRITE_BUFFER_BYTES:
                self._submit(WRITE_BUFFER_BYTES)
        self._pos += done
        return done

    def tell(self) -> int:
        """Bytes accepted so far (the file's size once flushed)."""
        return self._pos

    def fileno(self) -> int:
        """The file descriptor (for ``os.fsync`` after :meth:`flush`)."""
        return self._fd

    def flush(self) -> None:
        """Write everything accepted so far and set the file's exact size; no write may
        follow."""
        if self._finished:
            return
        self._finished = True
        if self._cur is not None and self._fill:
            padded = -(-self._fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
            self._bufs[self._cur][self._fill:padded] = bytes(padded - self._fill)
            self._submit(padded)
        self._drain()                          # the queue is FIFO: every write is done
        self._check()
        os.ftruncate(self._fd, self._pos)

    def _drain(self) -> None:
        self._work.put(None)
        self._thread.join()

    def close(self) -> None:
        """Stop the writer thread and release the descriptor and buffers (idempotent);
        bytes not flushed are lost."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._drain()
        os.close(self._fd)
        for b in self._bufs:
            b.close()
