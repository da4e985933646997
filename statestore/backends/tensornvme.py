"""``TensorNVMeStore``: states kept by TensorNVMe, a store of its own.

TensorNVMe keeps bytes under string keys in one file of its own, at offsets it chooses
(:mod:`statestore.io._tensornvme` lists what its binding offers and the defects the adapter
contains). It cannot write statestore's named safetensors files in place, so this store does
not pretend it does:

* each state is cut into **blocks** of ``block_bytes`` (a power of two, at most a quarter of
  the RAM budget, so that the cuts of optimizer passes, ``get``/``put`` and checkpoints fall on
  block boundaries); each block written is one TensorNVMe key ``"<param>/<state>#<i>"``, a
  block never written reads as zeros. A slice that starts or ends inside a block (a pipeline
  cut some other way) is read or merged through a bounce buffer of one block;
* checkpoints **copy** what the store reads back (checked against the checksum taken when it
  was written): there are no files to hard-link (its ``links`` are the default: none);
* :meth:`sync` waits for every write, ``fdatasync``\\ s TensorNVMe's file and drops it from the
  page cache (TensorNVMe has neither ``fsync`` nor ``O_DIRECT``): after it, the states are on
  the disk and the next reads come from there. Between syncs the page cache holds what was
  written since, up to ``max(4 * budget_bytes, 1 GiB)`` (then the adapter writes back and
  drops it);
* RAM: the pipeline's ``budget_bytes``, plus one block of bounce buffer and the adapter's 8 MiB
  scratch buffer (where a block's old bytes are read to free them before it is rewritten);
* a block read is written back under its key (TensorNVMe frees what it reads): a read-only
  pass (``get``, a checkpoint save) also rewrites what it reads, in the page cache.

The file is ``<dir>/states-<store id>-tensornvme``, present while the store holds a written
block; a lock file marks it as in use, and a store started later in ``dir`` removes it if this
process died without closing (``_dirs.py``).
"""
from __future__ import annotations

import errno
import os
import uuid
from concurrent.futures import Future
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._types import Slice, StateKey, StateSpec
from ..errors import StateStoreIOError, StateStoreValueError
from ..io import alloc_buffer
from ..io._tensornvme import TensorNVMeEngine
from .base import StreamingStore
from ._dirs import StoreLock, prepare_dir
from ._futures import completed, when_all

__all__ = ["TensorNVMeStore"]

_ALIGN = 4096
_MAX_BLOCK = 1 << 20


def _round_up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def _all(futs: List[Future], value: int) -> Future:
    """A future that completes with ``value`` once every one of ``futs`` has, or with the
    first exception among them."""
    if not futs:
        return completed(value)

    def finish(out: Future) -> None:
        for f in futs:
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
        out.set_result(value)

    return when_all(futs, finish)


class TensorNVMeStore(StreamingStore):
    """States kept by TensorNVMe in one file under ``dir``, through a bounded RAM budget.

    Args:
        dir: directory of TensorNVMe's file; ``None`` makes a temporary directory removed on
            :meth:`close` and at interpreter exit.
        budget_bytes: RAM for the pipeline's host buffers (default 256 MiB).
        queue_depth: TensorNVMe requests in flight (its ``n_entries``).
        block_bytes: largest block kept under one key (default 1 MiB; lowered to a power of
            two at most ``budget_bytes / 4``).
        backend: TensorNVMe's ``"uring"`` or ``"aio"`` (default: ``uring`` where built).
        pinned: page-lock the pipeline's host buffers.

    It is no :class:`~statestore.NVMeStore` (it shares none of its file code):
    ``NVMeStore(dir, engine="tensornvme")`` and :func:`statestore.backends.nvme_store`
    (``engine="tensornvme"``), the factory that takes NVMeStore's arguments, build this
    class.
    """

    alignment = _ALIGN

    def __init__(self, dir: Optional[str] = None, *, budget_bytes: Optional[int] = None,
                 queue_depth: int = 32, block_bytes: int = _MAX_BLOCK,
                 backend: Optional[str] = None, pinned: bool = True):
        super().__init__(budget_bytes=budget_bytes)
        if self.budget_bytes < 4 * _ALIGN:
            raise StateStoreValueError(f"TensorNVMeStore: budget_bytes must be at least "
                                       f"{4 * _ALIGN}, got {self.budget_bytes}")
        for arg, v in (("queue_depth", queue_depth), ("block_bytes", block_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise StateStoreValueError(f"TensorNVMeStore: {arg} must be a positive int, "
                                           f"got {v!r}")
        if block_bytes < _ALIGN or block_bytes & (block_bytes - 1):
            raise StateStoreValueError(f"TensorNVMeStore: block_bytes must be a power of two "
                                       f">= {_ALIGN}, got {block_bytes}")
        g = block_bytes
        while g > _ALIGN and g > self.budget_bytes // 4:
            g //= 2
        self.block_bytes = g
        # Callers cut states at multiples of this: pipeline slices are whole blocks.
        self.transfer_alignment = g
        dir, self._tmp, self._finalizer = prepare_dir(self, dir, "TensorNVMeStore",
                                                      "statestore-tnvme-", check_writable=True)
        self.dir = dir
        self._id = uuid.uuid4().hex[:8]
        self._pinned = bool(pinned)
        self._buffer = None          # the pipeline ring's AlignedBuffer
        self._bounce = None          # one block, for slices that cut a block
        self._stored: Dict[StateKey, set] = {}   # blocks written (the others read as zeros)
        self._removed_reported = False
        self._lock = StoreLock(dir, self._id)
        try:
            self._engine = TensorNVMeEngine(os.path.join(dir, f"states-{self._id}-tensornvme"),
                                            queue_depth=queue_depth, backend=backend,
                                            cache_bytes=max(4 * self.budget_bytes, 1 << 30))
        except BaseException:
            self._lock.release()
            if self._finalizer is not None:
                self._finalizer()
            raise

    # ------------------------------------------------------------------ layout
    def _allocate(self, entries: Sequence[Tuple[StateKey, StateSpec]]) -> None:
        for k, _ in entries:
            self._stored[k] = set()

    def _free(self, keys: Sequence[StateKey]) -> None:
        blocks = [(k, i) for k in keys for i in self._stored.pop(k, ())]
        if not blocks:
            return
        if not any(self._stored.values()):
            # Nothing else is kept: drop TensorNVMe's file, rather than read every block to
            # free it (the next write starts a fresh one).
            futs = [self._engine.reset()]
        else:
            futs = [self._engine.discard(self._key(k, i)) for k, i in blocks]
        for f in futs:
            f.result()

    @staticmethod
    def _key(k: StateKey, i: int) -> str:
        return f"{k}#{i}"

    def _blocks(self, s: Slice):
        """``(block index, block start, block size, lo, hi)`` for each block the slice
        touches: ``[lo, hi)`` are the slice's bytes in it, relative to the state's start."""
        spec = self._specs[s.key]
        a, b = s.start * spec.itemsize, s.stop * spec.itemsize
        g, total = self.block_bytes, spec.nbytes
        i = a // g
        while i * g < b:
            start = i * g
            size = min(g, total - start)
            yield i, start, size, max(a, start), min(b, start + size)
            i += 1

    @staticmethod
    def _bytes_view(t: torch.Tensor, nbytes: int) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)[:nbytes]

    def _bounce_view(self, nbytes: int) -> torch.Tensor:
        if self._bounce is None:
            self._bounce = alloc_buffer(self.block_bytes, pinned=False)
        return self._bounce.tensor[:nbytes]

    # ------------------------------------------------------------------ I/O primitives
    def _submit_read(self, s: Slice, out: torch.Tensor):
        spec = self._specs[s.key]
        a = s.start * spec.itemsize
        nbytes = s.numel * spec.itemsize
        if nbytes == 0:
            return completed(0)
        dst = self._bytes_view(out, nbytes)
        stored = self._stored[s.key]
        futs = []
        for i, start, size, lo, hi in self._blocks(s):
            part = dst[lo - a:hi - a]
            if i not in stored:
                part.zero_()
            elif lo == start and hi == start + size:
                futs.append(self._engine.read(self._key(s.key, i), part))
            else:           # the slice cuts this block: read it whole, keep the part
                b = self._bounce_view(size)
                self._engine.read(self._key(s.key, i), b).result()
                part.copy_(b[lo - start:hi - start])
        return _all(futs, nbytes)

    def _submit_write(self, s: Slice, src: torch.Tensor, *, optimizer_pass: bool = False):
        spec = self._specs[s.key]
        a = s.start * spec.itemsize
        nbytes = s.numel * spec.itemsize
        if nbytes == 0:
            return completed(0)
        self._check_present()
        data = self._bytes_view(src, nbytes)
        stored = self._stored[s.key]
        futs = []
        for i, start, size, lo, hi in self._blocks(s):
            key = self._key(s.key, i)
            part = data[lo - a:hi - a]
            if lo == start and hi == start + size:
                futs.append(self._engine.write(key, part))
            else:           # merge into the block (read-modify-write through the bounce)
                self.in_flight.wait_for(s.key)
                b = self._bounce_view(size)
                if i in stored:
                    self._engine.read(key, b).result()
                else:
                    b.zero_()
                b[lo - start:hi - start].copy_(part)
                self._engine.write(key, b).result()
            stored.add(i)
        return _all(futs, nbytes)

    def _alloc_host_buffer(self, nbytes: int) -> torch.Tensor:
        self._buffer = alloc_buffer(_round_up(nbytes), pinned=self._pinned)
        return self._buffer.tensor[:nbytes]

    def _check_present(self) -> None:
        if self._removed_reported or self._engine.fileno() < 0:
            return
        try:
            nlink = os.fstat(self._engine.fileno()).st_nlink
        except OSError as e:
            raise StateStoreIOError(e.errno, f"TensorNVMeStore: fstat of {self._engine.path} "
                                    f"failed: {e.strerror}", self._engine.path) from e
        if nlink == 0:
            self._removed_reported = True
            raise StateStoreIOError(errno.ENOENT, f"TensorNVMeStore: its file "
                                    f"{self._engine.path} was removed while the store was open; "
                                    "its states live on in the open file until close(), save a "
                                    "checkpoint to keep them", self._engine.path)

    def _check_files(self) -> None:
        self._check_present()

    def _flush(self) -> None:
        self._check_present()
        self._engine.flush(drop_cache=True).result()

    def _close(self) -> None:
        try:
            self._engine.close()
        finally:
            self._stored.clear()
            self._buffer = None
            self._bounce = None
            self._lock.release()
            if self._finalizer is not None:
                self._finalizer()

    # ------------------------------------------------------------------ introspection
    def files(self) -> List[str]:
        """TensorNVMe's file (not a safetensors file: its bytes are keyed blocks)."""
        return [self._engine.path]

    @property
    def engine(self) -> TensorNVMeEngine:
        return self._engine

    def _backend_stats(self) -> Dict[str, Any]:
        try:
            disk = os.fstat(self._engine.fileno()).st_size if self._engine.fileno() >= 0 else 0
        except OSError:
            disk = None
        return {
            "dir": self.dir,
            "files": 1,
            "disk_bytes": disk,
            "engine": self._engine.name,
            "tensornvme_backend": self._engine.backend,
            "block_bytes": self.block_bytes,
            "direct": False,
            "buffer_kind": self._buffer.kind if self._buffer is not None else None,
            "pinned_bytes": (self._buffer.nbytes if self._buffer is not None
                             and self._buffer.locked else 0),
            "engine_stats": self._engine.stats(),
        }
