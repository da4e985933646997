"""NVMeStore's copy-on-write: a state file a checkpoint links is *frozen* (never written
again); writes of its states go to its *successor*, a new file of the same layout, reserved
before a pipeline hands out its first unit; a state moves there once every element of it was
written, and a frozen file no other name links any more is *thawed* (docs/nvme.md,
"Checkpoints link the files")."""
from __future__ import annotations

import os
from typing import Dict, List

from .._types import Slice, StateKey, StateSpec
from ..errors import StateStoreIOError
from ..io import IOFile
from ._nvme_files import ALIGN, COPY_CHUNK, StateFile, add_range, check_present, round_up, \
    still_named
from ._nvme_packed import PackedStates, small
from ._nvme_table import FileTable
from ._space import check_space

__all__ = ["CopyOnWrite"]


class CopyOnWrite:
    """Keeps an NVMeStore's frozen files unchanged (module docstring); an object the store
    holds.

    Args:
        table: the store's :class:`~statestore.backends._nvme_table.FileTable` (its files,
            ``where``, ``cow`` ranges and successors).
        packed: the store's :class:`~statestore.backends._nvme_packed.PackedStates` (a
            small state moves with its whole block).
        specs: the store's states' specs by key (read).
        in_flight: the store's ``InFlightWrites`` (a copy waits for the state's writes).
        frozen_reads: the store's ``FrozenReads`` (bytes copied out of a frozen file are
            checked first).
    """

    def __init__(self, table: FileTable, packed: PackedStates, specs: Dict[StateKey, StateSpec],
                 in_flight, frozen_reads):
        self.table, self.packed, self.specs = table, packed, specs
        self.in_flight, self.frozen_reads = in_flight, frozen_reads

    def reserve_successors(self) -> None:
        """Give every frozen file that still holds states its successor now (reserved in
        full), so that no write of a step or a put creates a file half-way through. A frozen
        file no checkpoint links any more (its save failed, or the checkpoint was removed:
        only the store's own name is left) is thawed instead: written in place, as before the
        save."""
        need = []
        for sf in list(self.table.files.values()):
            if not sf.frozen or sf.successor is not None or not sf.keys:
                continue
            try:
                alone = os.fstat(sf.file.fd).st_nlink == 1 and still_named(sf)
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
                    f"by a checkpoint (new files for the states' next writes)", self.table.dir,
                    sum(sf.size for sf in need))
        made: List[StateFile] = []
        try:
            for sf in need:
                self.table.successor(sf)
                made.append(sf)
        except BaseException:
            for sf in made:
                succ, sf.successor = sf.successor, None
                self.table.drop(succ, unlink=True)
            raise

    def _writable(self, sf: StateFile) -> bool:
        """Reopen a read-only file for writing (a linked load's shard whose checkpoint is
        gone); False where that fails (the file then stays frozen: copy-on-write)."""
        if not sf.readonly:
            return True
        try:
            f = IOFile(sf.path, direct=self.table.direct)
        except StateStoreIOError:
            return False
        sf.old_file, sf.file, sf.readonly = sf.file, f, False
        return True

    def write_into_successor(self, s: Slice) -> StateFile:
        """The file a write of ``s`` goes to while its state's file is frozen."""
        table = self.table
        old, _ = table.where[s.key]
        new = table.successor(old)
        ranges = table.cow.setdefault(s.key, [])
        add_range(ranges, s.start, s.stop)
        if ranges == [[0, self.specs[s.key].numel]]:
            table.move_to(s.key, new)       # every element of it is in the successor now
        return new

    def materialize(self, k: StateKey) -> None:
        """Copy the elements of ``k`` still only in its frozen file into the successor and
        move ``k`` there (synchronous, through a small bounce buffer)."""
        table = self.table
        old, base = table.where[k]
        if not old.frozen:
            return
        spec = self.specs[k]
        if small(spec.nbytes):
            self.packed.materialize_block(old, base // ALIGN)        # with its whole block
            return
        new = table.successor(old)
        self.in_flight.wait_for(k)
        ranges = table.cow.get(k, [])
        gaps, pos = [], 0
        for a, b in ranges + [[spec.numel, spec.numel]]:
            if a > pos:
                gaps.append((pos, a))
            pos = max(pos, b)
        if gaps:
            self.frozen_reads.verify(old, k)       # its bytes there are the checkpoint's
            check_present(new)
            new.dirty = True
        for a, b in gaps:
            lo = base + a * spec.itemsize            # aligned: gaps start at unit starts
            hi = round_up(base + b * spec.itemsize)  # in this state's blocks (layout aligns)
            while lo < hi:
                n = min(COPY_CHUNK, hi - lo)
                table.engine.write(new.file, table.read_sync(old, lo, n), lo, n).result()
                lo += n
        table.move_to(k, new)

    def materialize_file(self, sf: StateFile) -> None:
        """Every state still (in part) in the frozen ``sf`` moved to its successor."""
        where = self.table.where
        for k in sorted(sf.keys, key=lambda k: where[k][1]):
            if where[k][0] is not sf:
                continue        # moved with its block
            if small(self.specs[k].nbytes):
                self.packed.materialize_block(sf, where[k][1] // ALIGN)
            else:
                self.materialize(k)
