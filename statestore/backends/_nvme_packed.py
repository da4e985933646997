"""NVMeStore's small states, packed: states of fewer than 4096 bytes share 4 KiB blocks of
their file, and pipelines move them by *extents*, runs of whole blocks that one request reads
or writes, instead of one 4 KiB request per state (docs/nvme.md, "Small states").

Layout (``_safetensors_layout.layout(pack=...)``): in a state file, the large states come
first; the small ones follow, each at a multiple of 64 bytes, none crossing a 4096-byte
boundary, none sharing a block with a large state. ``StateFile.blocks`` maps a block index to
the small states inside it (shared by a frozen file and its successor: same layout).

Rules that keep the bytes right whatever units a pipeline is made of:

* a block's small states always live in one file: a write that goes to a frozen file's
  successor (copy-on-write) writes whole blocks and moves every state of them;
* a block written whole from the ring holds only what this unit read (mode ``"rw"``) or
  zeros and the unit's own states (mode ``"w"``) where every state of the block is the
  unit's; otherwise it is *read-modify-written*: read fresh (after the block's pending
  writes), the unit's slices patched in, written whole;
* every read and write of a block first waits for the pending write of that block
  (``_block_writes``), so two writes of one block are never in flight together, and a
  read-modify-write never reads a block before an earlier write of it landed;
* the pipeline also registers the write under every state of the block it rewrote, so a
  later read of any of them waits for it, and a failed write marks them all as stale.
"""
from __future__ import annotations

from itertools import repeat
from functools import partial
from operator import attrgetter, is_not, itemgetter
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import xxhash

from .._types import Slice, StateKey, StateSpec
from ..io import alloc_buffer
from ..pipeline import Extent, UnitPlan
from ._futures import completed, when_all
from ._nvme_files import ALIGN, StateFile, check_present, round_up

__all__ = ["PackedStates", "SMALL_ALIGN", "MAX_EXTENT", "small", "ring_bytes", "index_blocks"]

#: where a small state starts in its block (the SIMD kernels' alignment)
SMALL_ALIGN = 64
#: most bytes one extent request moves
MAX_EXTENT = 1 << 20

_first = itemgetter(0)
_key = attrgetter("key")
_not_none = partial(is_not, None)


def _combined(futs: List) -> object:
    if len(futs) == 1:
        return futs[0]

    def finish(out) -> None:
        errs = [f.exception() for f in futs]
        err = next((e for e in errs if e is not None), None)
        if err is not None:
            out.set_exception(err)
        else:
            out.set_result(sum(f.result() for f in futs))
    return when_all(futs, finish)


def small(nbytes: int) -> bool:
    """A state of ``nbytes`` is packed into a shared block."""
    return 0 < nbytes < ALIGN


def ring_bytes(spec: StateSpec) -> int:
    """Ring bytes a state takes: a small state its 64-byte slots of a shared block."""
    if small(spec.nbytes):
        return round_up(spec.nbytes, SMALL_ALIGN)
    return round_up(spec.nbytes)


def index_blocks(sf: StateFile, entries, where) -> None:
    """Record the blocks of ``sf`` that hold the small states among ``entries`` (``(key,
    spec)`` pairs, their places in ``where``), in file order."""
    for k, spec in sorted(entries, key=lambda e: where[e[0]][1]):
        if small(spec.nbytes):
            sf.blocks.setdefault(where[k][1] // ALIGN, []).append(k)


class PackedStates:
    """Lays out, reads and writes an NVMeStore's small states by extents (module docstring);
    an object the store holds, and its ``store.extents``: the pipeline calls its
    :meth:`unit_plan`, :meth:`start_extent` and :meth:`write_extent`.

    Args:
        table: the store's :class:`~statestore.backends._nvme_table.FileTable` (``where``,
            successors, moves, reads kept open, its engine).
        specs: the store's states' specs by key (read).
        digests: the store's ``WriteDigests`` (checksums of states written whole).
        frozen_reads: the store's ``FrozenReads`` (reads of frozen files checked).
    """

    def __init__(self, table, specs: Dict[StateKey, StateSpec], digests, frozen_reads):
        self.table, self.specs = table, specs
        self.digests, self.frozen_reads = digests, frozen_reads
        # (file path, block) -> the future of its last write, until it completes
        self._block_writes: Dict[str, Dict[int, object]] = {}     # file path -> block -> future
        self._rmw_buf = None

    # ------------------------------------------------------------------ the plan
    def unit_plan(self, slices: Sequence[Slice]) -> Optional[UnitPlan]:
        """How a pipeline lays a unit of ``slices`` out: None when it holds no small state."""
        specs, where = self.specs, self.table.where
        packed: Dict[Tuple[int, int], List[int]] = {}
        fams: Dict[int, StateFile] = {}
        loose: List[int] = []
        for i, s in enumerate(slices):
            if not small(specs[s.key].nbytes):
                loose.append(i)
                continue
            sf, off = where[s.key]
            fams[id(sf.blocks)] = sf
            packed.setdefault((id(sf.blocks), off // ALIGN), []).append(i)
        if not packed:
            return None
        offsets = [0] * len(slices)
        extents: List[Extent] = []
        pos = 0
        run: Optional[List] = None          # [family, first block, last block, members]
        for fam, b in sorted(packed):
            if run is not None and run[0] == fam and run[2] == b - 1 \
                    and (b - run[1] + 1) * ALIGN <= MAX_EXTENT:
                run[2] = b
            else:
                if run is not None:
                    pos = self._add_extent(extents, fams, run, pos)
                run = [fam, b, b, []]
            for i in packed[fam, b]:
                offsets[i] = pos + (b - run[1]) * ALIGN + where[slices[i].key][1] % ALIGN
                run[3].append(i)
        pos = self._add_extent(extents, fams, run, pos)
        for e in extents:
            e.slices = [slices[i] for i in e.members]
            e.whole = self._whole(e)
        for i in loose:
            offsets[i] = pos
            pos += round_up(slices[i].numel * specs[slices[i].key].itemsize)
        return UnitPlan(pos, offsets, extents, loose)

    @staticmethod
    def _add_extent(extents: List[Extent], fams, run, pos: int) -> int:
        fam, b0, b1, members = run
        n = (b1 - b0 + 1) * ALIGN
        extents.append(Extent(pos, n, members, (fams[fam], b0, b1 + 1)))
        return pos + n

    def _whole(self, e: Extent) -> bool:
        """Whether every state of ``e``'s blocks is one of its members, taken whole."""
        fam, b0, b1 = e.where
        mine = e.slices
        keys = {s.key for s in mine if s.start == 0 and s.stop == self.specs[s.key].numel}
        return len(keys) == len(mine) and \
            all(k in keys for b in range(b0, b1) for k in fam.blocks.get(b, ()))

    def _runs(self, e: Extent) -> List[Tuple[StateFile, int, int]]:
        """``e``'s blocks cut where their current file changes: ``(file, first, end)``; kept
        on ``e`` until a state moves (to a frozen file's successor) or the layout changes."""
        table = self.table
        at = (table.version, table.moves)
        if e.runs is not None and e.runs[0] == at:
            return e.runs[1]
        fam, b0, b1 = e.where
        # each block's current file, in C-level maps (a unit has thousands of blocks)
        files = list(map(_first, map(table.where.__getitem__,
                                     map(_first, map(fam.blocks.__getitem__, range(b0, b1))))))
        out: List[Tuple[StateFile, int, int]] = []
        for b, sf in zip(range(b0, b1), files):
            if out and out[-1][0] is sf:
                out[-1] = (sf, out[-1][1], b + 1)
            else:
                out.append((sf, b, b + 1))
        e.runs = (at, out)
        return out

    def _wait_blocks(self, sf: StateFile, b0: int, b1: int) -> None:
        """Wait for the pending writes of blocks ``[b0, b1)`` of ``sf`` (C-level pops)."""
        pending = self._block_writes.get(sf.path)
        if not pending:
            return
        futs = list(filter(_not_none, map(pending.pop, range(b0, b1), repeat(None))))
        for fut in dict(zip(map(id, futs), futs)).values():       # each future once
            try:
                fut.result()
            except BaseException:       # noqa: BLE001 - the pipeline reports it with its slices
                pass

    # ------------------------------------------------------------------ reads
    def start_extent(self, e: Extent, buf: torch.Tensor, slices: List[Slice], read: bool):
        """Start reading extent ``e`` into ``buf`` (``read``; else zero it: written whole)."""
        fam, b0, b1 = e.where
        table = self.table
        if not read:
            buf.zero_()         # written whole: pads and gaps stay zero
            return completed(0)
        futs = []
        checks = []
        for sf, r0, r1 in self._runs(e):
            self._wait_blocks(sf, r0, r1)
            lo = (r0 - b0) * ALIGN
            futs.append(table.reading(sf, table.engine.read(
                sf.file, buf[lo:lo + (r1 - r0) * ALIGN], r0 * ALIGN, (r1 - r0) * ALIGN)))
            if sf.frozen and sf.hashes:
                checks += [(sf, s, b0) for s in slices if r0 <= table.where[s.key][1] // ALIGN < r1]
        fut = _combined(futs)
        if checks:
            fut = self.frozen_reads.extent(fut, checks, buf, self._check_whole)
        return fut

    def _check_whole(self, sf: StateFile, s: Slice, b0: int, buf: torch.Tensor) -> None:
        """Verify the state of ``s`` read from the frozen ``sf`` into ``buf`` (extent from
        block ``b0``) against its recorded checksum."""
        k = s.key
        nbytes = self.specs[k].nbytes
        if s.start or s.stop != self.specs[k].numel:
            self.frozen_reads.verify(sf, k)         # a part of it: the whole state, read now
            return
        off = self.table.where[k][1] - b0 * ALIGN
        self.frozen_reads.check(sf, k, buf[off:off + nbytes].numpy())

    # ------------------------------------------------------------------ writes
    def write_extent(self, e: Extent, buf: torch.Tensor, slices: List[Slice],
                     tensors: List[torch.Tensor], optimizer_pass: bool):
        """Start writing extent ``e`` from ``buf``; returns (the write's future, keys of the
        states rewritten)."""
        fam, b0, b1 = e.where
        table = self.table
        specs, where = self.specs, table.where
        covered: List[StateKey] = list(map(_key, slices))
        mine: Dict[int, List[Slice]] = {}
        if not e.whole:         # else no block holds another unit's state or a part of one
            for s in slices:
                mine.setdefault(where[s.key][1] // ALIGN, []).append(s)
        futs = []
        for sf, r0, r1 in self._runs(e):
            self._wait_blocks(sf, r0, r1)
            if not e.whole:
                covered += self._merge_blocks(sf, fam, r0, r1, b0, buf, mine)
            target = table.successor(sf) if sf.frozen else sf
            check_present(target)
            target.dirty = True
            lo = (r0 - b0) * ALIGN
            fut = table.engine.write(target.file, buf[lo:lo + (r1 - r0) * ALIGN], r0 * ALIGN,
                                     (r1 - r0) * ALIGN)
            futs.append(fut)
            self._block_writes.setdefault(target.path, {}).update(
                dict.fromkeys(range(r0, r1), fut))
            if target is not sf:
                for b in range(r0, r1):
                    for k in fam.blocks[b]:
                        table.move_to(k, target)
        if optimizer_pass:
            self.digests.forget_many(covered[:len(slices)])
        else:
            for s in slices:
                if s.start or s.stop != specs[s.key].numel:
                    self.digests.forget(s.key)
                else:
                    off = where[s.key][1] % ALIGN + (where[s.key][1] // ALIGN - b0) * ALIGN
                    self.digests.record(s.key, xxhash.xxh3_64(
                        buf[off:off + specs[s.key].nbytes].numpy()).hexdigest())
        return _combined(futs), covered

    def _merge_blocks(self, sf: StateFile, fam: StateFile, r0: int, r1: int, b0: int,
                      buf: torch.Tensor, mine: Dict[int, List[Slice]]) -> List[StateKey]:
        """Read-modify-write the blocks ``[r0, r1)`` of ``buf`` (extent from ``b0``) that
        hold another unit's states or a part of one of ours; returns those other states."""
        specs = self.specs
        covered: List[StateKey] = []
        for b in range(r0, r1):
            ours = mine.get(b, ())
            keys = {s.key for s in ours}
            whole = {s.key for s in ours if s.start == 0 and s.stop == specs[s.key].numel}
            if any(k not in whole for k in fam.blocks[b]):
                # another unit's states, or a part of ours: the block as it is now,
                # with our slices patched in
                self._merge_block(sf, b, buf[(b - b0) * ALIGN:(b - b0 + 1) * ALIGN], ours)
                covered += [k for k in fam.blocks[b] if k not in keys]
        return covered

    def _merge_block(self, sf: StateFile, b: int, block: torch.Tensor,
                     mine: Sequence[Slice]) -> None:
        """Read-modify-write of block ``b``: its current bytes, with the bytes of the slices
        ``mine`` (in ``block`` already, as the unit left them) patched in."""
        if self._rmw_buf is None:
            self._rmw_buf = alloc_buffer(ALIGN, pinned=False)
        fresh = self._rmw_buf.tensor
        where = self.table.where
        self.table.engine.read(sf.file, fresh, b * ALIGN, ALIGN).result()
        if sf.frozen and sf.hashes:         # the others' bytes go on to the successor
            keys = {s.key for s in mine}
            for k in sf.blocks.get(b, ()):
                if k not in keys:
                    off = where[k][1] % ALIGN
                    self.frozen_reads.check(sf, k, fresh[off:off + self.specs[k].nbytes]
                                            .numpy())
        for s in mine:
            item = self.specs[s.key].itemsize
            off = where[s.key][1] % ALIGN + s.start * item
            n = (s.stop - s.start) * item
            fresh[off:off + n].copy_(block[off:off + n])
        block.copy_(fresh)

    def materialize_block(self, sf: StateFile, b: int) -> None:
        """Copy block ``b`` of the frozen ``sf`` to its successor and move its states there."""
        table = self.table
        new = table.successor(sf)
        self._wait_blocks(sf, b, b + 1)
        self._wait_blocks(new, b, b + 1)
        for k in sf.blocks.get(b, ()):
            self.frozen_reads.verify(sf, k)
        check_present(new)
        new.dirty = True
        table.engine.write(new.file, table.read_sync(sf, b * ALIGN, ALIGN), b * ALIGN,
                           ALIGN).result()
        for k in list(sf.blocks.get(b, ())):
            table.move_to(k, new)
