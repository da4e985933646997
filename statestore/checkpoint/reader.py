"""Reading tensors out of checkpoint shards: parallel ``preadv`` on local files, fsspec
reads elsewhere, every byte handed to a hash in file order (:class:`ShardReader`)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from ..errors import CheckpointCorruptError, StateStoreError, StateStoreIOError
from .filesystem import is_local

__all__ = ["ShardReader", "reader_pool", "READ_PIECE", "READ_THREADS"]

READ_PIECE = 8 * 1024 * 1024
READ_THREADS = 4


class ShardReader:
    """Reads byte ranges of one shard. Local files: pieces of :data:`READ_PIECE` bytes with
    up to :data:`READ_THREADS` ``preadv`` calls in flight (a disk serves several requests
    faster than one stream: benchmarks/RESULTS.md), hashed in
    order as they arrive. Other filesystems: fsspec's sequential reads."""

    def __init__(self, fs, fpath: str, pool: Optional[ThreadPoolExecutor]):
        self.fpath, self.pool, self.fd, self.f = fpath, pool, None, None
        try:
            if pool is not None and is_local(fs):
                self.fd = os.open(fpath, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            else:
                self.f = fs.open(fpath, "rb")
        except OSError as e:
            raise CheckpointCorruptError(f"{fpath}: cannot read the shard: {e}") from e

    def read(self, view: memoryview, offset: int, key: str, on_piece=None) -> None:
        """Fill ``view`` from byte ``offset``; ``on_piece(piece)`` sees the bytes in order."""
        if self.fd is None:
            self.f.seek(offset)
            _read_exact(self.f, view, self.fpath, key)
            if on_piece is not None:
                on_piece(view)
            return
        n = len(view)
        starts = range(0, n, READ_PIECE)
        if len(starts) <= 1:
            self._piece(view, offset, key)
            if on_piece is not None:
                on_piece(view)
            return
        futs = [self.pool.submit(self._piece, view[a:a + READ_PIECE], offset + a, key)
                for a in starts]
        err: Optional[BaseException] = None
        for a, fu in zip(starts, futs):
            try:
                fu.result()
                if on_piece is not None and err is None:
                    on_piece(view[a:a + READ_PIECE])
            except BaseException as e:      # wait for every piece: none may write later
                err = err or e
        if err is not None:
            raise err

    def _piece(self, mv: memoryview, offset: int, key: str) -> None:
        got = 0
        while got < len(mv):
            try:
                n = os.preadv(self.fd, [mv[got:]], offset + got)
            except OSError as e:
                raise StateStoreIOError(e.errno, f"{self.fpath}: reading tensor {key!r} "
                                                 f"failed: {e.strerror}") from e
            if n == 0:
                raise CheckpointCorruptError(f"{self.fpath}: truncated while reading tensor "
                                             f"{key!r}")
            got += n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.f is not None:
            self.f.close()
            self.f = None

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reader_pool() -> ThreadPoolExecutor:
    """The thread pool a :class:`ShardReader` of local files reads its pieces on."""
    return ThreadPoolExecutor(READ_THREADS, thread_name_prefix="statestore-ckpt-read")


def _read_exact(f, view: memoryview, fpath: str, key: str) -> None:
    got = 0
    while got < len(view):
        try:
            n = f.readinto(view[got:]) if hasattr(f, "readinto") else None
            if n is None:
                data = f.read(len(view) - got)
                n = len(data)
                view[got:got + n] = data
        except OSError as e:
            if isinstance(e, StateStoreError):
                raise
            raise StateStoreIOError(e.errno, f"{fpath}: reading tensor {key!r} failed: "
                                    f"{e}") from e
        if not n:
            raise CheckpointCorruptError(f"{fpath}: truncated while reading tensor {key!r}")
        got += n
