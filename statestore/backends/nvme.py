"""``NVMeStore``: states in safetensors files on disk, moved with asynchronous direct I/O
through a bounded RAM budget.

Layout (``docs/nvme.md``): each batch of states created together (one ``create_many`` call)
is one file ``<dir>/states-<store id>-<n>.safetensors``, a valid safetensors file at all times:
its header is written at creation, every tensor's data starts at a multiple of 4096 bytes
(larger tensors: of up to 1 MiB, ``_data_alignment``), ``__pad__/<n>`` U8 tensors fill the
gaps (and one before the zero-length ``__pad__/end`` makes the file size a multiple of
4096), and the data region is reserved with ``posix_fallocate``
(so ENOSPC shows at creation, not mid-step) and reads as zeros until written. After
:meth:`~statestore.StateStore.sync` the files hold every state's current value, so stock
``safetensors.safe_open`` (or a checkpoint that copies files) sees it.

I/O goes through one :class:`~statestore.io.IOEngine` per store (``engine="auto"``: io_uring,
else libaio, else the thread pool) on ``O_DIRECT`` descriptors, from a ring of 4096-aligned,
page-locked host buffers of ``budget_bytes`` owned by the pipeline: RSS stays within the
budget whatever the states' size, and the page cache does not hold the states. Where the
filesystem refuses ``O_DIRECT``, I/O is buffered (one warning) and every transferred range is
written back and dropped from the page cache.
"""
from __future__ import annotations

import atexit
import errno
import inspect
import os
import struct
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import xxhash

from .._safetensors_layout import PAD_PREFIX, layout
from .._types import Slice, StateKey, StateSpec
from ..errors import StateStoreIOError, StateStoreValueError
from ..io import IOEngine, IOFile, alloc_buffer, make_engine
from ..store import LinkableFile, StateStore
from ._dirs import StoreLock, create_laid_out, prepare_dir
from ._futures import completed, when_all
from ._space import check_space, no_space, reclaimable_bytes

__all__ = ["NVMeStore"]

_ALIGN = 4096
# Most bytes of states in one file (a larger state gets a file of its own): the default bound
# of a checkpoint shard (checkpoint.DEFAULT_SHARD_BYTES), so a checkpoint can link the files.
_MAX_FILE_DATA = 2 << 30
_COPY_CHUNK = 1 << 20       # bounce buffer of copy-on-write copies
# Where a state's data starts in its file: a multiple of 4096 (direct I/O), and for larger
# states of up to _MAX_DATA_ALIGN, the largest power of two at most 1/32 of its size (<= 3%
# of padding). Disks are faster with data that was written in requests aligned to their
# internal granularity: on this machine's virtual disk (64 KiB units), 1 GiB written from a
# file offset of 4 KiB read back at 4.56 GB/s, from 64 KiB..2 MiB at 5.05-5.14 GB/s (and
# wrote ~10% slower); see docs/nvme.md, "Alignment of the data".
_MAX_DATA_ALIGN = 1 << 20


def _data_alignment(nbytes: int) -> int:
    a = _ALIGN
    while a < _MAX_DATA_ALIGN and a * 2 * 32 <= nbytes:
        a *= 2
    return a


def _add_range(ranges: List[List[int]], a: int, b: int) -> None:
    """Merge ``[a, b)`` into the sorted, disjoint ``ranges``."""
    out: List[List[int]] = []
    for r in ranges:
        if r[1] < a or r[0] > b:
            out.append(r)
        else:
            a, b = min(a, r[0]), max(b, r[1])
    out.append([a, b])
    out.sort()
    ranges[:] = out


def _covered(ranges: List[List[int]], a: int, b: int) -> int:
    """Elements of ``[a, b)`` inside ``ranges``."""
    return sum(max(0, min(b, r[1]) - max(a, r[0])) for r in ranges)


def _round_up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def _unlink_all(paths: set) -> None:
    for p in list(paths):
        try:
            os.unlink(p)
        except OSError:
            pass
    paths.clear()


def _after(write: Future, other: Optional[Future]) -> Future:
    """A future with ``write``'s outcome that completes once ``other`` has completed too (the
    ring buffer of a write is reused only after its checksum job has read it)."""
    if other is None:
        return write

    def finish(out: Future) -> None:
        err = write.exception()
        if err is not None:
            out.set_exception(err)
        else:
            out.set_result(write.result())

    return when_all([write, other], finish)


class _Digest:
    """An xxh3-64 in progress over one state written in order; ``ok`` turns False if a
    chunk could not be hashed, and the digest is then never recorded."""
    __slots__ = ("h", "ok")

    def __init__(self):
        self.h = xxhash.xxh3_64()
        self.ok = True


class _StateFile:
    __slots__ = ("path", "file", "size", "header", "keys", "removed_reported", "dirty",
                 "frozen", "successor", "hashes", "mapped", "readonly", "old_file")

    def __init__(self, path: str, file: IOFile, size: int, header: bytes):
        self.path, self.file, self.size, self.header = path, file, size, header
        self.keys: set = set()          # live states whose current value is in this file
        self.removed_reported = False
        self.dirty = False              # written since the last fsync
        # Frozen: a checkpoint links this file, so the store never writes it again; writes of
        # its states go to ``successor`` (same layout), and a state moves there once every
        # element of it was written (``NVMeStore._cow``). ``hashes``: checksums of its states'
        # data, valid for as long as they stay here (frozen bytes never change).
        self.frozen = False
        self.successor: Optional["_StateFile"] = None
        self.hashes: Dict[StateKey, str] = {}
        # Mapped by a ``state_dict()`` snapshot (statestore/_snapshot.py): never thawed, even
        # once no checkpoint links it, since the snapshot's tensors read its pages.
        self.mapped = False
        # Opened read-only (a checkpoint's shard taken by a linked load); ``old_file``: that
        # descriptor, kept open for reads in flight, once the file was reopened for writing
        # (thawed after the checkpoint was removed).
        self.readonly = False
        self.old_file: Optional[IOFile] = None


class NVMeStore(StateStore):
    """States in files under ``dir``, read and written with asynchronous direct I/O.

    Args:
        dir: directory of the state files; ``None`` makes a temporary directory removed on
            :meth:`close` and at interpreter exit.
        engine: ``"auto"``, ``"io_uring"``, ``"libaio"``, ``"threads"``, an
            :class:`~statestore.io.IOEngine` instance that writes in place (not closed by the
            store), or ``"tensornvme"``, which builds a
            :class:`~statestore.backends.tensornvme.TensorNVMeStore` instead (TensorNVMe keeps
            keyed bytes in a file of its own and cannot write these files in place; an
            engine with ``writes_in_place=False`` is refused).
        budget_bytes: RAM for the pipeline's host buffers (read-ahead, compute, write-behind);
            default 256 MiB. Nothing else of the states is held in RAM.
        queue_depth, block_size, io_threads: engine settings (requests in flight, bytes per
            request, workers of the thread-pool engine). The defaults, 32 blocks of 8 MiB
            (256 MiB in flight), beat 128 blocks of 1 MiB here: 1 GiB of puts + ``sync`` at
            3.86 against 2.49 GB/s, a cold pipeline read at 1.61 against 0.91 GB/s
            (``benchmarks/nvme_io.py --store-sweep``, medians of 5 interleaved rounds; see
            docs/nvme.md, "Block size and queue depth").
        pinned: page-lock the host buffers (``cudaHostRegister`` with CUDA, else ``mlock``
            where permitted; ``stats()["buffer_kind"]`` says what was obtained).
        direct: ``None`` probes ``O_DIRECT`` (buffered with one warning where unsupported),
            ``True`` requires it, ``False`` uses buffered I/O with the page cache dropped.
        keep_files: leave the state files in ``dir`` at close (ignored for ``dir=None``).
    """

    resident = False
    alignment = _ALIGN
    transfer_alignment = _MAX_DATA_ALIGN

    def __new__(cls, dir: Optional[str] = None, engine: Any = "auto", **kwargs):
        # engine="tensornvme": TensorNVMe cannot write these files in place (it keeps keyed
        # bytes in a file of its own), so the store made for it is built instead.
        if cls is NVMeStore and isinstance(engine, str) and engine == "tensornvme":
            from .tensornvme import TensorNVMeStore
            return TensorNVMeStore._from_nvme_args(dir, **kwargs)
        return super().__new__(cls)

    def __init__(self, dir: Optional[str] = None, engine: Any = "auto", *,
                 budget_bytes: Optional[int] = None, queue_depth: int = 32,
                 block_size: int = 8 << 20, io_threads: int = 8, pinned: bool = True,
                 direct: Optional[bool] = None, keep_files: bool = False):
        super().__init__(budget_bytes=budget_bytes)
        if self.budget_bytes < 4 * _ALIGN:
            raise StateStoreValueError(f"NVMeStore: budget_bytes must be at least {4 * _ALIGN}, "
                                       f"got {self.budget_bytes}")
        if direct not in (None, True, False):
            raise StateStoreValueError(f"NVMeStore: direct must be None, True or False, got {direct!r}")
        if not getattr(engine, "writes_in_place", True):
            # Its reads of slices and hard links of named files need every write to land at
            # the (file, offset) asked: a keyed engine would leave the files unwritten.
            raise StateStoreValueError(
                f"NVMeStore: engine {getattr(engine, 'name', engine)!r} does not write in place "
                "(writes_in_place is False), and NVMeStore reads slices of its named files and "
                "links them into checkpoints; use NVMeStore(dir, engine='tensornvme'), a "
                "TensorNVMeStore, for TensorNVMe")
        if not isinstance(engine, IOEngine):
            for arg, v in (("queue_depth", queue_depth), ("block_size", block_size),
                           ("io_threads", io_threads)):
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise StateStoreValueError(f"NVMeStore: {arg} must be a positive int, "
                                               f"got {v!r}")
        dir, self._tmp, self._finalizer = prepare_dir(self, dir, "NVMeStore", "statestore-nvme-",
                                                      check_writable=True)
        self.dir = dir
        self.keep_files = bool(keep_files) and self._tmp is None
        self._paths: set = set()     # files to remove at close or interpreter exit
        if self._tmp is None and not self.keep_files:
            self._finalizer = weakref.finalize(self, _unlink_all, self._paths)
            atexit.register(self._finalizer)
        self._direct = direct
        self._pinned = bool(pinned)
        self._id = uuid.uuid4().hex[:8]
        self._nfiles = 0
        self._files: Dict[str, _StateFile] = {}
        self._where: Dict[StateKey, Tuple[_StateFile, int]] = {}   # key -> (file, data offset)
        # xxh3-64 of states put or loaded in order since their last other write (_hash_written);
        # the hashing itself runs on one worker thread, in submission order.
        self._digests: Dict[StateKey, str] = {}
        self._hashing: Dict[StateKey, Tuple[_Digest, int]] = {}
        self._finishing: Dict[StateKey, _Digest] = {}      # last chunk submitted, digest due
        self._hash_lock = threading.Lock()
        self._hash_pool: Optional[ThreadPoolExecutor] = None
        # States of a frozen file written in part since: key -> element ranges whose current
        # value is in the file's successor (the rest is still in the frozen file).
        self._cow: Dict[StateKey, List[List[int]]] = {}
        self._buffer = None          # the pipeline ring's AlignedBuffer
        self._bounce = None          # 4 KiB buffer for read-modify-write of partial blocks
        self._copy_buf = None        # bounce buffer of copy-on-write copies
        if isinstance(engine, IOEngine):
            self._engine, self._own_engine = engine, False
        elif isinstance(engine, str):
            self._engine = make_engine(engine, queue_depth=queue_depth, block_size=block_size,
                                       threads=io_threads, directory=dir)
            self._own_engine = True
        else:
            raise StateStoreValueError(f"NVMeStore: engine must be a name or an IOEngine, "
                                       f"got {engine!r}")
        # Held while open: a store started later in this directory knows these files are in
        # use; if this process dies without close(), that store reclaims them (_dirs.py).
        self._lock = None if self.keep_files else StoreLock(dir, self._id)
        if self._lock is not None:
            self._paths.add(self._lock.path)

    # ------------------------------------------------------------------ layout
    def _allocate(self, entries: Sequence[Tuple[StateKey, StateSpec]]) -> None:
        # Files of at most _MAX_FILE_DATA bytes of states (a larger state gets a file of its
        # own): the bound of a checkpoint shard, so a checkpoint can link them (docs/nvme.md).
        batches: List[List[Tuple[StateKey, StateSpec]]] = []
        size = 0
        for k, spec in entries:
            if not batches or (batches[-1] and size + spec.nbytes > _MAX_FILE_DATA):
                batches.append([])
                size = 0
            batches[-1].append((k, spec))
            size += spec.nbytes
        lays = [self._layout_file(b) for b in batches]
        # Every file's size is known before the first is created: a filesystem that cannot
        # hold them all refuses now, naming bytes needed and free, with nothing written.
        first = os.path.join(self.dir, f"states-{self._id}-{self._nfiles:05d}.safetensors")
        more = f" and {len(lays) - 1} more state file(s)" if len(lays) > 1 else ""
        check_space(f"NVMeStore: creating {first}{more} for {len(entries)} state(s)", self.dir,
                    sum(_round_up(lay.file_size) for lay in lays))
        created: List[_StateFile] = []
        try:
            for lay in lays:
                created.append(self._new_file(lay.header, _round_up(lay.file_size)))
        except BaseException:
            for sf in created:          # all or nothing: no file of this batch stays
                self._drop_file(sf, unlink=True)
            raise
        for batch, lay, sf in zip(batches, lays, created):
            for k, _ in batch:
                self._where[k] = (sf, lay.entries[str(k)].offset)
                sf.keys.add(k)

    @staticmethod
    def _layout_file(entries: Sequence[Tuple[StateKey, StateSpec]]):
        names = [(str(k), spec.dtype, spec.shape) for k, spec in entries]
        names.append((f"{PAD_PREFIX}end", torch.uint8, (0,)))
        return layout(names, align=_ALIGN, pad_tensors=True, align_for=_data_alignment,
                      metadata={"format": "statestore-nvmestore"})

    def _new_file(self, header: bytes, size: int) -> _StateFile:
        """Create, reserve and open a state file holding ``header``."""
        path = os.path.join(self.dir, f"states-{self._id}-{self._nfiles:05d}.safetensors")
        self._nfiles += 1
        try:
            fd = create_laid_out(path, size, header)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise no_space(f"NVMeStore: cannot create {path}", path, size,
                               code=e.errno) from e
            raise StateStoreIOError(e.errno, f"NVMeStore: cannot create {path} ({size} bytes): "
                                    f"{e.strerror}", path) from e
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise StateStoreIOError(e.errno, f"NVMeStore: cannot lay out {path} ({size} bytes): "
                                    f"{e.strerror}", path) from e
        os.close(fd)
        try:
            f = IOFile(path, direct=self._direct)
        except StateStoreIOError:
            os.unlink(path)
            raise
        sf = _StateFile(path, f, size, header)
        self._files[path] = sf
        if not self.keep_files:
            self._paths.add(path)
        return sf

    def _free(self, keys: Sequence[StateKey]) -> None:
        for k in keys:
            sf, _ = self._where.pop(k)
            self._cow.pop(k, None)
            self._forget_digest(k)
            self._leave(sf, k)

    def _leave(self, sf: _StateFile, k: StateKey) -> None:
        """``k``'s current value is no longer in ``sf``: remove the file once none is (and
        its successor, when that never received a whole state)."""
        sf.keys.discard(k)
        sf.hashes.pop(k, None)
        if sf.keys or any(f.successor is sf and f.keys for f in self._files.values()):
            return
        # Safe to close: a state leaves a file when its last range was written, after the
        # pipeline read it, so no read of this file is in flight.
        self._drop_file(sf, unlink=True)
        succ = sf.successor
        if succ is not None and not succ.keys and succ.path in self._files:
            self._drop_file(succ, unlink=True)

    def _drop_file(self, sf: _StateFile, unlink: bool) -> None:
        self._files.pop(sf.path, None)
        try:
            sf.file.close()
            if sf.old_file is not None:
                sf.old_file.close()
        finally:
            if unlink:
                self._paths.discard(sf.path)
                try:
                    os.unlink(sf.path)
                except FileNotFoundError:
                    pass

    # ------------------------------------------------------------------ I/O primitives
    def _locate(self, s: Slice) -> Tuple[_StateFile, int, int, int]:
        """(file, byte offset of the slice, exact bytes, item size) of the slice's current
        value (its offsets are the same in a frozen file and its successor)."""
        sf, base = self._where[s.key]
        item = self._specs[s.key].itemsize
        ranges = self._cow.get(s.key)
        if ranges is not None and s.stop > s.start:
            done = _covered(ranges, s.start, s.stop)
            if done == s.stop - s.start:
                sf = sf.successor
            elif done:
                self._materialize(s.key)
                sf, base = self._where[s.key]
        return sf, base + s.start * item, s.numel * item, item

    @staticmethod
    def _bytes_view(t: torch.Tensor, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` starting at ``t``'s first byte, in the same storage
        (the pipeline guarantees the rounded-up size is inside its aligned region)."""
        storage = t.untyped_storage()
        start = t.storage_offset() * t.element_size()
        if start + nbytes > storage.nbytes():
            raise StateStoreValueError(f"buffer of {storage.nbytes() - start} bytes cannot hold "
                                       f"{nbytes} bytes of aligned I/O")
        return torch.empty(0, dtype=torch.uint8).set_(storage, start, (nbytes,))

    def _submit_read(self, s: Slice, out: torch.Tensor):
        sf, off, nbytes, _ = self._locate(s)
        if nbytes == 0:
            return completed(0)
        n = _round_up(nbytes)
        return self._engine.read(sf.file, self._bytes_view(out, n), off, n)

    def _submit_write(self, s: Slice, src: torch.Tensor, *, optimizer_pass: bool = False):
        spec = self._specs[s.key]
        nbytes = s.numel * spec.itemsize
        if nbytes == 0:
            return completed(0)
        if optimizer_pass:
            # An optimizer pass: its threads compute between writes, and on few cores any
            # work added here comes out of the training step (hashing 1 GB a step of the
            # GPT-2 example took 0.05 s of backward's hooks). No checksum: a save that links
            # the file reads the state back from disk to hash it (docs/nvme.md).
            self._forget_digest(s.key)
            return self._write_slice(s, spec, src, nbytes)
        hashed = self._hash_written(s, spec, src, nbytes)
        try:
            return _after(self._write_slice(s, spec, src, nbytes), hashed)
        except BaseException:
            if hashed is not None:
                self._forget_digest(s.key)
                hashed.result()     # the checksum job reads src: let it finish first
            raise

    def _write_slice(self, s: Slice, spec: StateSpec, src: torch.Tensor, nbytes: int) -> Future:
        sf, base = self._where[s.key]
        off = base + s.start * spec.itemsize
        end = off + nbytes
        tail = s.stop < spec.numel and end % _ALIGN
        if sf.frozen:
            if tail:
                # The merge below reads the block's other elements: take the whole state
                # over first, so they come from its current place.
                self._materialize(s.key)
                sf, _ = self._where[s.key]
            else:
                sf = self._write_into_successor(s)
        self._check_present(sf)
        sf.dirty = True
        n = _round_up(nbytes)
        if tail:
            # The slice ends inside a block that holds later elements of the same state:
            # merge that block (read-modify-write), then write the aligned prefix.
            self._wait_pending_key(s.key)
            n -= _ALIGN
            self._merge_tail_block(sf, off + n, self._bytes_view(src, nbytes)[n:])
        elif n > nbytes:
            # The last block of the state: its bytes past the state's end are the file's pad,
            # which must stay zero (a linked shard's pads are checked by load and verify), and
            # the ring holds stale bytes there. The pipeline gave this slice the whole block.
            self._bytes_view(src, n)[nbytes:].zero_()
        if n == 0:
            return completed(nbytes)
        return self._engine.write(sf.file, self._bytes_view(src, n), off, n)

    def _hash_written(self, s: Slice, spec: StateSpec, src: torch.Tensor,
                      nbytes: int) -> Optional[Future]:
        """Checksum (the checkpoint's xxh3-64) of a state's bytes as they are written by puts
        and loads: a state written from its first to its last element in order (as every put
        and checkpoint load does) gets its digest without the disk being read again; any
        other write order, and any optimizer pass, forgets it (a save then reads the state to
        hash it). The hashing runs on a worker thread while this thread goes on (it held the
        caller for as long as the copy into the ring did); the returned future completes once
        it has read ``src``. Digests are complete once :meth:`sync` returns, as every write
        is."""
        k = s.key
        with self._hash_lock:
            self._digests.pop(k, None)
            self._finishing.pop(k, None)
            if s.start == 0:
                self._hashing.pop(k, None)
                d = _Digest()
            else:
                prev = self._hashing.pop(k, None)
                if prev is None or prev[1] != s.start:
                    return None
                d = prev[0]
            final = s.stop == spec.numel
            if final:
                self._finishing[k] = d
            else:
                self._hashing[k] = (d, s.stop)
        view = memoryview(self._bytes_view(src, nbytes).numpy())
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="ss-hash")
        return self._hash_pool.submit(self._hash_chunk, k, d, view, final)

    def _hash_chunk(self, k: StateKey, d: _Digest, view: memoryview, final: bool) -> None:
        try:
            if d.ok:
                d.h.update(view)
        except BaseException:
            d.ok = False
        if final:
            with self._hash_lock:
                if self._finishing.get(k) is d:
                    del self._finishing[k]
                    if d.ok:
                        self._digests[k] = d.h.hexdigest()

    def _forget_digest(self, k: StateKey) -> None:
        with self._hash_lock:
            self._digests.pop(k, None)
            self._hashing.pop(k, None)
            self._finishing.pop(k, None)

    # ------------------------------------------------------------------ copy-on-write
    def pipeline(self, units, mode: str = "rw", wait: bool = True):
        # A pipeline that writes reserves what copy-on-write needs before it hands out the
        # first unit: a step then completes or changes nothing, even on a full disk.
        self._check_open()
        if mode != "r":
            self._reserve_successors()
        return super().pipeline(units, mode=mode, wait=wait)

    def _reserve_successors(self) -> None:
        """Give every frozen file that still holds states its successor now (reserved in
        full), so that no write of a step or a put creates a file half-way through. A frozen
        file no checkpoint links any more (its save failed, or the checkpoint was removed:
        only the store's own name is left) is thawed instead: written in place, as before the
        save."""
        need = []
        for sf in list(self._files.values()):
            if not sf.frozen or sf.successor is not None or not sf.keys:
                continue
            try:
                alone = os.fstat(sf.file.fd).st_nlink == 1 and self._named(sf)
            except OSError:
                alone = False
            if alone and not sf.mapped and self._writable(sf):
                sf.frozen = False
                sf.hashes = {}          # bytes of a thawed file change again
            else:
                need.append(sf)
        if not need:
            return
        check_space(f"NVMeStore: copy-on-write of {need[0].path}"
                    f"{f' and {len(need) - 1} more file(s)' if len(need) > 1 else ''}, linked "
                    f"by a checkpoint (new files for the states' next writes)", self.dir,
                    sum(sf.size for sf in need))
        made: List[_StateFile] = []
        try:
            for sf in need:
                sf.successor = self._new_file(sf.header, sf.size)
                made.append(sf)
        except BaseException:
            for sf in made:
                succ, sf.successor = sf.successor, None
                self._drop_file(succ, unlink=True)
            raise

    def _writable(self, sf: _StateFile) -> bool:
        """Reopen a read-only file for writing (a linked load's shard whose checkpoint is
        gone); False where that fails (the file then stays frozen: copy-on-write)."""
        if not sf.readonly:
            return True
        try:
            f = IOFile(sf.path, direct=self._direct)
        except StateStoreIOError:
            return False
        sf.old_file, sf.file, sf.readonly = sf.file, f, False
        return True

    def _successor(self, sf: _StateFile) -> _StateFile:
        if sf.successor is None:
            sf.successor = self._new_file(sf.header, sf.size)
        return sf.successor

    def _move(self, k: StateKey) -> None:
        """Every element of ``k`` is now in its frozen file's successor."""
        old, base = self._where[k]
        new = old.successor
        self._cow.pop(k, None)
        self._where[k] = (new, base)
        new.keys.add(k)
        self._leave(old, k)

    def _write_into_successor(self, s: Slice) -> _StateFile:
        """The file a write of ``s`` goes to while its state's file is frozen."""
        old, _ = self._where[s.key]
        new = self._successor(old)
        ranges = self._cow.setdefault(s.key, [])
        _add_range(ranges, s.start, s.stop)
        if ranges == [[0, self._specs[s.key].numel]]:
            self._move(s.key)
        return new

    def _materialize(self, k: StateKey) -> None:
        """Copy the elements of ``k`` still only in its frozen file into the successor and
        move ``k`` there (synchronous, through a small bounce buffer)."""
        old, base = self._where[k]
        if not old.frozen:
            return
        new = self._successor(old)
        spec = self._specs[k]
        self._wait_pending_key(k)
        ranges = self._cow.get(k, [])
        gaps, pos = [], 0
        for a, b in ranges + [[spec.numel, spec.numel]]:
            if a > pos:
                gaps.append((pos, a))
            pos = max(pos, b)
        if gaps:
            self._check_present(new)
            new.dirty = True
            if self._copy_buf is None:
                self._copy_buf = alloc_buffer(_COPY_CHUNK, pinned=False)
            buf = self._copy_buf.tensor
        for a, b in gaps:
            lo = base + a * spec.itemsize            # aligned: gaps start at unit starts
            hi = _round_up(base + b * spec.itemsize)  # in this state's blocks (layout aligns)
            while lo < hi:
                n = min(_COPY_CHUNK, hi - lo)
                self._engine.read(old.file, buf[:n], lo, n).result()
                self._engine.write(new.file, buf[:n], lo, n).result()
                lo += n
        self._move(k)

    def _materialize_file(self, sf: _StateFile) -> None:
        for k in sorted(sf.keys, key=lambda k: self._where[k][1]):
            self._materialize(k)

    def _merge_tail_block(self, sf: _StateFile, block_off: int, head: torch.Tensor) -> None:
        if self._bounce is None:
            self._bounce = alloc_buffer(_ALIGN, pinned=False)
        b = self._bounce.tensor
        self._engine.read(sf.file, b, block_off, _ALIGN).result()
        b[:head.numel()].copy_(head)
        self._engine.write(sf.file, b, block_off, _ALIGN).result()

    def _alloc_host_buffer(self, nbytes: int) -> torch.Tensor:
        self._buffer = alloc_buffer(_round_up(nbytes), pinned=self._pinned)
        return self._buffer.tensor[:nbytes]

    def _check_present(self, sf: _StateFile) -> None:
        if sf.removed_reported:
            return
        try:
            nlink = os.fstat(sf.file.fd).st_nlink
        except OSError as e:
            raise StateStoreIOError(e.errno, f"NVMeStore: fstat of {sf.path} failed: {e.strerror}",
                                    sf.path) from e
        if nlink == 0:
            sf.removed_reported = True
            raise StateStoreIOError(errno.ENOENT, f"NVMeStore: state file {sf.path} was removed "
                                    "while the store was open; its states live on in the open "
                                    "file until close(), save a checkpoint to keep them", sf.path)

    def _check_files(self) -> None:
        # Before any pipeline: a removed file is reported once (its states live on in the open
        # file until close()); a truncated one every time (the states past its end are gone,
        # and a later write would silently refill the gap with zeros).
        for sf in list(self._files.values()):
            self._check_present(sf)
            try:
                size = os.fstat(sf.file.fd).st_size
            except OSError as e:
                raise StateStoreIOError(e.errno, f"NVMeStore: fstat of {sf.path} failed: "
                                        f"{e.strerror}", sf.path) from e
            if size < sf.size:
                raise StateStoreIOError(
                    errno.EIO, f"NVMeStore: state file {sf.path} was truncated to {size} bytes "
                    f"while the store was open (it had {sf.size}); the states past that point "
                    "are lost: load a checkpoint", sf.path)

    def _flush(self) -> None:
        for sf in list(self._files.values()):
            self._check_present(sf)
            if sf.dirty:
                sf.dirty = False
                sf.file.fsync()

    def _close(self) -> None:
        try:
            if self.keep_files:
                # The files left behind hold every state's current value: finish moving
                # states out of frozen files.
                for sf in [f for f in self._files.values() if f.frozen and f.keys]:
                    self._materialize_file(sf)
        finally:
            self._close_engine_and_files()

    def _close_engine_and_files(self) -> None:
        try:
            if self._own_engine:
                self._engine.close()
        finally:
            for sf in list(self._files.values()):
                self._drop_file(sf, unlink=not self.keep_files)
            self._where.clear()
            self._cow.clear()
            if self._hash_pool is not None:
                self._hash_pool.shutdown(wait=True)
                self._hash_pool = None
            with self._hash_lock:
                self._digests.clear()
                self._hashing.clear()
                self._finishing.clear()
            self._buffer = None
            self._bounce = None
            self._copy_buf = None
            if self._lock is not None:
                self._lock.release()
                self._paths.discard(self._lock.path)
            if self._finalizer is not None:
                self._finalizer()

    # ------------------------------------------------------------------ checkpoint links
    def _linkable(self, keys: Sequence[StateKey], root: str, shard_bytes: int) -> List[LinkableFile]:
        try:
            if os.stat(root).st_dev != os.stat(self.dir).st_dev:
                return []           # another filesystem: no hard links
        except OSError:
            return []
        # A file truncated (or removed, reported once) under the store raises here, as reading
        # its states for a copy would: a link must never make a damaged file a shard.
        self._check_files()
        # A successor reserved but never written (no state of its frozen file was written
        # since): let it go, the frozen file is still current and can be linked again.
        for sf in [f for f in self._files.values() if f.frozen and f.successor is not None]:
            succ = sf.successor
            if not succ.keys and not any(k in self._cow for k in sf.keys) \
                    and succ.path in self._files:
                sf.successor = None
                self._drop_file(succ, unlink=True)
        # A frozen file whose states were partly rewritten: move the rest to its successor,
        # so every file linked holds the current value of every state it has.
        for sf in [f for f in self._files.values() if f.frozen and f.successor is not None]:
            self._materialize_file(sf)
        self._flush()
        wanted = set(keys)
        out = []
        linked = []
        for sf in self._files.values():
            if not sf.keys or not sf.keys <= wanted or not self._named(sf):
                continue
            if len(sf.keys) > 1 and sum(self._specs[k].nbytes for k in sf.keys) > shard_bytes:
                continue
            linked.append(sf)
        # After this save, the next write of each linked file's states goes to a new file of
        # the same size (copy-on-write): refuse the save now, before anything is linked,
        # when the filesystem will not have that room once the save removed what it replaces.
        cow = sum(sf.size for sf in self._files.values()
                  if sf.keys and sf.successor is None and (sf.frozen or sf in linked))
        if linked:
            check_space(f"NVMeStore: a checkpoint in {root} linking {linked[0].path}"
                        f"{f' and {len(linked) - 1} more file(s)' if len(linked) > 1 else ''} "
                        f"(the store's next writes then copy them)", self.dir, cow,
                        extra_free=reclaimable_bytes(root))
        for sf in linked:
            rows = sorted(((k, self._where[k][1]) for k in sf.keys), key=lambda r: r[1])
            hashes = dict(sf.hashes)
            with self._hash_lock:
                hashes.update((k, self._digests[k]) for k in sf.keys
                              if k in self._digests and k not in self._damaged)
            out.append(LinkableFile(rows, hashes, self._link_file(sf, hashes)))
        return out

    @staticmethod
    def _named(sf: _StateFile) -> bool:
        """``sf.path`` still names the open file (it was not removed or replaced)."""
        try:
            a, b = os.stat(sf.path), os.fstat(sf.file.fd)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def _link_file(self, sf: _StateFile, hashes: Dict[StateKey, str]):
        def link(dst: str, mapped: bool = False) -> None:
            sf.frozen = True        # first: from here on the store never writes this file
            if mapped:
                sf.mapped = True
            os.link(sf.path, dst)
            sf.hashes = hashes      # frozen bytes: these (and those the save adds) stay valid
        return link

    def _adopt(self, path: str, rows: Sequence[Tuple[StateKey, StateSpec, int, str]],
               names: Sequence[str]) -> bool:
        """Take the checkpoint shard ``path`` as a state file by hard link instead of copying
        it, frozen from the start (the store never writes it: its states' writes go to a new
        file, copy-on-write, as after a linked save) and opened read-only. Possible where the
        shard is on this store's filesystem, its size and every tensor's data offset are
        multiples of 4096 (direct I/O; shards a linked save took from an NVMeStore are) and
        it holds exactly ``rows`` (``names``: its tensors, pads excluded). ``rows``:
        ``(key, spec, data offset, checksum)``; the caller verifies the checksums."""
        try:
            st = os.stat(path)
            if st.st_dev != os.stat(self.dir).st_dev:
                return False            # another filesystem: copied
        except OSError:
            return False
        if st.st_size % _ALIGN or any(off % _ALIGN for _, _, off, _ in rows) \
                or sorted(names) != sorted(str(k) for k, _, _, _ in rows):
            return False
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = f.read(n)
        except (OSError, struct.error):
            return False
        header = struct.pack("<Q", n) + header
        if len(header) != 8 + n or any(off < len(header) for _, _, off, _ in rows):
            return False
        dst = os.path.join(self.dir, f"states-{self._id}-{self._nfiles:05d}.safetensors")
        self._nfiles += 1
        try:
            os.link(path, dst)
        except OSError:
            return False
        try:
            f = IOFile(dst, readonly=True, direct=self._direct)
        except StateStoreIOError:
            os.unlink(dst)
            return False
        sf = _StateFile(dst, f, st.st_size, header)
        sf.frozen = sf.readonly = True
        self._files[dst] = sf
        if not self.keep_files:
            self._paths.add(dst)
        for k, _, off, checksum in rows:
            self._where[k] = (sf, off)
            sf.keys.add(k)
            sf.hashes[k] = checksum     # verified by the caller, else the load clears us
        return True

    # ------------------------------------------------------------------ introspection
    def files(self) -> List[str]:
        """Paths of the store's safetensors files."""
        return list(self._files)

    def location(self, key) -> Tuple[str, int, int]:
        """``(path, byte offset, nbytes)`` of a state's data in its file (valid after
        :meth:`sync`)."""
        from ..store import _as_key

        k = _as_key(key)
        spec = self.spec(k)
        if k in self._cow:
            self._materialize(k)
        sf, off = self._where[k]
        return sf.path, off, spec.nbytes

    @property
    def engine(self) -> IOEngine:
        return self._engine

    def _backend_stats(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "dir": self.dir,
            "files": len(self._files),
            "disk_bytes": sum(sf.size for sf in self._files.values()),
            "engine": self._engine.name,
            "direct": all(sf.file.direct for sf in self._files.values()) if self._files else None,
            "buffer_kind": self._buffer.kind if self._buffer is not None else None,
            "pinned_bytes": (self._buffer.nbytes if self._buffer is not None
                             and self._buffer.locked else 0),
            # of the ring, on transparent huge pages (docs/nvme.md, "Huge-page buffers")
            "huge_page_bytes": self._buffer.huge_bytes() if self._buffer is not None else 0,
        }
        out["engine_stats"] = self._engine.stats()
        return out


# Its own __new__ would otherwise be what inspect.signature(NVMeStore) shows.
NVMeStore.__signature__ = inspect.signature(NVMeStore.__init__).replace(
    parameters=list(inspect.signature(NVMeStore.__init__).parameters.values())[1:])


def _register_tensornvme() -> None:
    # NVMeStore(dir, engine="tensornvme") returns a TensorNVMeStore: it is an NVMeStore to
    # isinstance (a virtual subclass; it shares none of NVMeStore's file code).
    from .tensornvme import TensorNVMeStore
    NVMeStore.register(TensorNVMeStore)


_register_tensornvme()
