"""``NVMeStore``: states in safetensors files on disk, moved with asynchronous direct I/O
through a bounded RAM budget.

Layout (``docs/nvme.md``): each batch of states created together (one ``create_many`` call)
is one file ``<dir>/states-<store id>-<n>.safetensors``, a valid safetensors file at all times:
its header is written at creation, every tensor's data of 4096 bytes or more starts at a
multiple of 4096 bytes (larger tensors: of up to 1 MiB, ``data_alignment``), smaller ones are
packed into shared 4 KiB blocks (``_nvme_packed.py``), ``__pad__/<n>`` U8 tensors fill the
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
import uuid
import weakref
from concurrent.futures import Future
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._access import PipelineAccess
from .._safetensors_layout import PAD_PREFIX, layout
from .._types import Slice, StateKey, StateSpec, as_key
from ..errors import StateStoreValueError
from ..io import IOEngine, alloc_buffer, make_engine
from ._dirs import StoreLock, prepare_dir
from ._futures import completed
from ._nvme_cow import CopyOnWrite
from ._nvme_digests import FrozenReads, WriteDigests
from ._nvme_files import (ALIGN, MAX_DATA_ALIGN, MAX_FILE_DATA, StateFile, after_both,
                          check_present, check_size, covered, data_alignment, round_up,
                          unlink_all)
from ._nvme_links import NVMeLinks
from ._nvme_packed import SMALL_ALIGN, PackedStates, index_blocks, ring_bytes, small
from ._nvme_table import FileTable
from ._space import check_space
from .base import StreamingStore

__all__ = ["NVMeStore"]


class NVMeStore(StreamingStore):
    """States in files under ``dir``, read and written with asynchronous direct I/O.

    Args:
        dir: directory of the state files; ``None`` makes a temporary directory removed on
            :meth:`close` and at interpreter exit.
        engine: ``"auto"``, ``"io_uring"``, ``"libaio"``, ``"threads"``, an
            :class:`~statestore.io.IOEngine` instance that writes in place (not closed by the
            store). ``"tensornvme"`` raises :class:`StateStoreValueError` naming
            ``TensorNVMeStore(dir)``: TensorNVMe keeps keyed bytes in a file of its own and
            cannot write these files in place, so it has a store of its own,
            :class:`~statestore.TensorNVMeStore` (which is no ``NVMeStore``). Any other
            engine with ``writes_in_place=False`` is refused too.
        budget_bytes: RAM for the pipeline's host buffers (read-ahead, compute, write-behind);
            default 256 MiB. Nothing else of the states is held in RAM.
        queue_depth, block_size, io_threads: engine settings (requests in flight, bytes per
            request, workers of the thread-pool engine). The defaults, 32 blocks of 8 MiB
            (256 MiB in flight), were faster than 128 blocks of 1 MiB on a virtual disk that
            takes requests of up to 4 MiB (``benchmarks/nvme_io.py --store-sweep``; docs/nvme.md,
            "Block size and queue depth").
        pinned: page-lock the host buffers (``cudaHostRegister`` with CUDA, else ``mlock``
            where permitted; ``stats()["buffer_kind"]`` says what was obtained).
        direct: ``None`` probes ``O_DIRECT`` (buffered with one warning where unsupported),
            ``True`` requires it, ``False`` uses buffered I/O with the page cache dropped.
        keep_files: leave the state files in ``dir`` at close (ignored for ``dir=None``).
    """

    alignment = ALIGN
    transfer_alignment = MAX_DATA_ALIGN

    def __init__(self, dir: Optional[str] = None, engine: Any = "auto", *,
                 budget_bytes: Optional[int] = None, queue_depth: int = 32,
                 block_size: int = 8 << 20, io_threads: int = 8, pinned: bool = True,
                 direct: Optional[bool] = None, keep_files: bool = False):
        super().__init__(budget_bytes=budget_bytes)
        if self.budget_bytes < 4 * ALIGN:
            raise StateStoreValueError(f"NVMeStore: budget_bytes must be at least {4 * ALIGN}, "
                                       f"got {self.budget_bytes}")
        if direct not in (None, True, False):
            raise StateStoreValueError(f"NVMeStore: direct must be None, True or False, got {direct!r}")
        if isinstance(engine, str) and engine == "tensornvme":
            raise StateStoreValueError(
                f"{type(self).__name__}: engine 'tensornvme' cannot write NVMeStore's files "
                "in place (TensorNVMe keeps keyed bytes in a file of its own): use TensorNVMe's "
                "own store, statestore.TensorNVMeStore(dir) (or statestore.backends."
                "nvme_store(dir, engine='tensornvme'), which builds one)")
        if not getattr(engine, "writes_in_place", True):
            # Its reads of slices and hard links of named files need every write to land at
            # the (file, offset) asked: a keyed engine would leave the files unwritten.
            raise StateStoreValueError(
                f"NVMeStore: engine {getattr(engine, 'name', engine)!r} does not write in place "
                "(writes_in_place is False), and NVMeStore reads slices of its named files and "
                "links them into checkpoints; use statestore.TensorNVMeStore(dir) for TensorNVMe")
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
            self._finalizer = weakref.finalize(self, unlink_all, self._paths)
            atexit.register(self._finalizer)
        self._pinned = bool(pinned)
        self._buffer = None          # the pipeline ring's AlignedBuffer
        self._bounce = None          # 4 KiB buffer for read-modify-write of partial blocks
        if isinstance(engine, IOEngine):
            self._engine, self._own_engine = engine, False
        elif isinstance(engine, str):
            self._engine = make_engine(engine, queue_depth=queue_depth, block_size=block_size,
                                       threads=io_threads, directory=dir)
            self._own_engine = True
        else:
            raise StateStoreValueError(f"NVMeStore: engine must be a name or an IOEngine, "
                                       f"got {engine!r}")
        store_id = uuid.uuid4().hex[:8]
        # The objects the store holds, each given what it uses: its files and where each
        # state is (_nvme_table.py), the checksums of states written whole and the checks
        # of reads from frozen files (_nvme_digests.py), the small states packed into shared
        # blocks (_nvme_packed.py), copy-on-write of frozen files (_nvme_cow.py) and how
        # checkpoints link these files and adopt theirs (store.links, _nvme_links.py).
        table = self._table = FileTable(dir, store_id, self._engine, direct,
                                        None if self.keep_files else self._paths)
        self._digests = WriteDigests()
        self._frozen_reads = FrozenReads(lambda k: (table.where[k][1], self._specs[k].nbytes),
                                         table.read_sync)
        self._packed = PackedStates(table, self._specs, self._digests, self._frozen_reads)
        self.extents = self._packed     # the pipeline moves units with small states by it
        self._copy_on_write = CopyOnWrite(table, self._packed, self._specs, self.in_flight,
                                          self._frozen_reads)
        # a pipeline that writes first reserves what copy-on-write needs (the successors of
        # frozen files), so a step completes or changes nothing, even on a full disk
        self._access = PipelineAccess(self, before_write=self._copy_on_write.reserve_successors)
        # Held while open: a store started later in this directory knows these files are in
        # use; if this process dies without close(), that store reclaims them (_dirs.py).
        self._lock = None if self.keep_files else StoreLock(dir, store_id)
        if self._lock is not None:
            self._paths.add(self._lock.path)
        self.links = NVMeLinks(dir, table.files, table.where, self._digests, self.in_flight,
                               self.spec, self._settle_files, self._take_file)

    # ------------------------------------------------------------------ layout
    def _ring_bytes(self, spec: StateSpec) -> int:
        return ring_bytes(spec)         # a small state: its 64-byte slots of a shared block

    def _allocate(self, entries: Sequence[Tuple[StateKey, StateSpec]]) -> None:
        # Files of at most MAX_FILE_DATA bytes of states (a larger state gets a file of its
        # own): the bound of a checkpoint shard, so a checkpoint can link them (docs/nvme.md).
        batches: List[List[Tuple[StateKey, StateSpec]]] = []
        size = 0
        for k, spec in entries:
            if not batches or (batches[-1] and size + spec.nbytes > MAX_FILE_DATA):
                batches.append([])
                size = 0
            batches[-1].append((k, spec))
            size += spec.nbytes
        lays = [self._layout_file(b) for b in batches]
        # Every file's size is known before the first is created: a filesystem that cannot
        # hold them all refuses now, naming bytes needed and free, with nothing written.
        table = self._table
        first = table.next_path()
        more = f" and {len(lays) - 1} more state file(s)" if len(lays) > 1 else ""
        check_space(f"NVMeStore: creating {first}{more} for {len(entries)} state(s)", self.dir,
                    sum(round_up(lay.file_size) for lay in lays))
        created: List[StateFile] = []
        try:
            for lay in lays:
                created.append(table.new_file(lay.header, round_up(lay.file_size)))
        except BaseException:
            for sf in created:          # all or nothing: no file of this batch stays
                table.drop(sf, unlink=True)
            raise
        table.version += 1
        for batch, lay, sf in zip(batches, lays, created):
            for k, _ in batch:
                table.where[k] = (sf, lay.entries[str(k)].offset)
                sf.keys.add(k)
            index_blocks(sf, batch, table.where)

    @classmethod
    def _layout_file(cls, entries: Sequence[Tuple[StateKey, StateSpec]]):
        # the large states first, then the small ones packed into shared blocks
        # (_nvme_packed.py): a 16-element state takes 64 bytes of the file, not 4 KiB
        names = [(str(k), spec.dtype, spec.shape) for k, spec in entries
                 if not small(spec.nbytes)]
        names += [(str(k), spec.dtype, spec.shape) for k, spec in entries
                  if small(spec.nbytes)]
        names.append((f"{PAD_PREFIX}end", torch.uint8, (0,)))
        return layout(names, align=ALIGN, pad_tensors=True, align_for=data_alignment,
                      metadata={"format": "statestore-nvmestore"}, pack=(ALIGN, SMALL_ALIGN))

    def _free(self, keys: Sequence[StateKey]) -> None:
        table = self._table
        table.version += 1
        for k in keys:
            sf, off = table.where.pop(k)
            block = sf.blocks.get(off // ALIGN)
            if block is not None and k in block:
                block.remove(k)
                if not block:
                    del sf.blocks[off // ALIGN]
            table.cow.pop(k, None)
            self._digests.forget(k)
            self._frozen_reads.forget(k)
            table.leave(sf, k)

    # ------------------------------------------------------------------ I/O primitives
    def _locate(self, s: Slice) -> Tuple[StateFile, int, int, int]:
        """(file, byte offset of the slice, exact bytes, item size) of the slice's current
        value (its offsets are the same in a frozen file and its successor)."""
        where = self._table.where
        sf, base = where[s.key]
        item = self._specs[s.key].itemsize
        ranges = self._table.cow.get(s.key)
        if ranges is not None and s.stop > s.start:
            done = covered(ranges, s.start, s.stop)
            if done == s.stop - s.start:
                sf = sf.successor
            elif done:
                self._copy_on_write.materialize(s.key)
                sf, base = where[s.key]
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
        n = round_up(nbytes)
        view = self._bytes_view(out, n)
        fut = self._table.reading(sf, self._engine.read(sf.file, view, off, n))
        return self._frozen_reads.read(sf, s, self._specs[s.key].numel, view[:nbytes].numpy(), fut)

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
            self._digests.forget(s.key)
            return self._write_slice(s, spec, src, nbytes)
        # The hashing runs on a worker thread while this thread goes on (it held the caller
        # for as long as the copy into the ring did); ``hashed`` completes once it has read
        # ``src``. Digests are complete once sync() returns, as every write is.
        hashed = self._digests.written(s, spec.numel,
                                       memoryview(self._bytes_view(src, nbytes).numpy()))
        try:
            return after_both(self._write_slice(s, spec, src, nbytes), hashed)
        except BaseException:
            if hashed is not None:
                self._digests.forget(s.key)
                hashed.result()     # the checksum job reads src: let it finish first
            raise

    def _write_slice(self, s: Slice, spec: StateSpec, src: torch.Tensor, nbytes: int) -> Future:
        sf, base = self._table.where[s.key]
        off = base + s.start * spec.itemsize
        end = off + nbytes
        tail = s.stop < spec.numel and end % ALIGN
        if sf.frozen:
            if tail:
                # The merge below reads the block's other elements: take the whole state
                # over first, so they come from its current place.
                self._copy_on_write.materialize(s.key)
                sf, _ = self._table.where[s.key]
            else:
                sf = self._copy_on_write.write_into_successor(s)
        self._check_present(sf)
        sf.dirty = True
        n = round_up(nbytes)
        if tail:
            # The slice ends inside a block that holds later elements of the same state:
            # merge that block (read-modify-write), then write the aligned prefix.
            self.in_flight.wait_for(s.key)
            n -= ALIGN
            self._merge_tail_block(sf, off + n, self._bytes_view(src, nbytes)[n:])
        elif n > nbytes:
            # The last block of the state: its bytes past the state's end are the file's pad,
            # which must stay zero (a linked shard's pads are checked by load and verify), and
            # the ring holds stale bytes there. The pipeline gave this slice the whole block.
            self._bytes_view(src, n)[nbytes:].zero_()
        if n == 0:
            return completed(nbytes)
        return self._engine.write(sf.file, self._bytes_view(src, n), off, n)

    def _merge_tail_block(self, sf: StateFile, block_off: int, head: torch.Tensor) -> None:
        if self._bounce is None:
            self._bounce = alloc_buffer(ALIGN, pinned=False)
        b = self._bounce.tensor
        self._engine.read(sf.file, b, block_off, ALIGN).result()
        b[:head.numel()].copy_(head)
        self._engine.write(sf.file, b, block_off, ALIGN).result()

    def _alloc_host_buffer(self, nbytes: int) -> torch.Tensor:
        self._buffer = alloc_buffer(round_up(nbytes), pinned=self._pinned)
        return self._buffer.tensor[:nbytes]

    def _check_present(self, sf: StateFile) -> None:
        check_present(sf)

    def _check_files(self) -> None:
        # Before any pipeline: a removed file is reported once (its states live on in the open
        # file until close()); a truncated one every time (the states past its end are gone,
        # and a later write would silently refill the gap with zeros).
        for sf in list(self._table.files.values()):
            check_present(sf)
            check_size(sf)

    def _flush(self) -> None:
        for sf in list(self._table.files.values()):
            self._check_present(sf)
            if sf.dirty:
                sf.dirty = False
                sf.file.fsync()

    # ------------------------------------------------------------------ checkpoint links
    def _settle_files(self) -> None:
        """Before files are linked: each must hold the current value of every state it has."""
        # A file truncated (or removed, reported once) under the store raises here.
        self._check_files()
        table = self._table
        # A successor reserved but never written (no state of its frozen file was written
        # since): let it go, the frozen file is still current and can be linked again.
        for sf in [f for f in table.files.values() if f.frozen and f.successor is not None]:
            succ = sf.successor
            if not succ.keys and not any(k in table.cow for k in sf.keys) \
                    and succ.path in table.files:
                sf.successor = None
                table.drop(succ, unlink=True)
        # A frozen file whose states were partly rewritten: move the rest to its successor.
        for sf in [f for f in table.files.values() if f.frozen and f.successor is not None]:
            self._copy_on_write.materialize_file(sf)
        self._flush()

    def _take_file(self, path: str, size: int, header: bytes, rows) -> bool:
        """Register the checkpoint shard ``path`` (checked by :class:`NVMeLinks`) as a state
        file by hard link: frozen from the start, opened read-only; ``rows``: ``(key, spec,
        data offset, checksum)``."""
        table = self._table
        sf = table.link_file(path, size, header)
        if sf is None:
            return False
        table.version += 1
        for k, _, off, checksum in rows:
            table.where[k] = (sf, off)
            sf.keys.add(k)
            sf.hashes[k] = checksum     # verified by the caller, else the load clears us
        index_blocks(sf, [(k, spec) for k, spec, _, _ in rows], table.where)
        return True

    def _close(self) -> None:
        try:
            if self.keep_files:
                # The files left behind hold every state's current value: finish moving
                # states out of frozen files.
                for sf in [f for f in self._table.files.values() if f.frozen and f.keys]:
                    self._copy_on_write.materialize_file(sf)
        finally:
            self._close_engine_and_files()

    def _close_engine_and_files(self) -> None:
        try:
            if self._own_engine:
                self._engine.close()
        finally:
            self._table.close(unlink=not self.keep_files)
            self._digests.close()
            self._buffer = None
            self._bounce = None
            if self._lock is not None:
                self._lock.release()
                self._paths.discard(self._lock.path)
            if self._finalizer is not None:
                self._finalizer()

    # ------------------------------------------------------------------ introspection
    @property
    def layout_version(self) -> int:
        """A number that changes whenever states are created, removed or loaded (``create``,
        ``delete``, ``clear``, ``load_checkpoint``, ``close``): where states lie in the
        store's files. Pipelines over the same units reuse their checked layout while it
        holds (``statestore/_unit_cache.py``)."""
        return self._table.version

    def files(self) -> List[str]:
        """Paths of the store's safetensors files."""
        return list(self._table.files)

    def location(self, key) -> Tuple[str, int, int]:
        """``(path, byte offset, nbytes)`` of a state's data in its file (valid after
        :meth:`sync`)."""
        k = as_key(key)
        spec = self.spec(k)
        if k in self._table.cow:
            self._copy_on_write.materialize(k)
        sf, off = self._table.where[k]
        return sf.path, off, spec.nbytes

    @property
    def engine(self) -> IOEngine:
        return self._engine

    def _backend_stats(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "dir": self.dir,
            "files": len(self._table.files),
            "disk_bytes": sum(sf.size for sf in self._table.files.values()),
            "engine": self._engine.name,
            "direct": (all(sf.file.direct for sf in self._table.files.values())
                       if self._table.files else None),
            "buffer_kind": self._buffer.kind if self._buffer is not None else None,
            "pinned_bytes": (self._buffer.nbytes if self._buffer is not None
                             and self._buffer.locked else 0),
            # of the ring, on transparent huge pages (docs/nvme.md, "Huge-page buffers")
            "huge_page_bytes": self._buffer.huge_bytes() if self._buffer is not None else 0,
        }
        out["engine_stats"] = self._engine.stats()
        return out
